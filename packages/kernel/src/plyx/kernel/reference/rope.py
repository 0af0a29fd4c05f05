"""``rope(x, cos, sin, *, interleaved=False)``: rotary position embedding of the first R dims (reference).

x is ``[B, T, H, Dh]``; cos and sin are ``[T, R/2]`` or ``[B, T, R/2]``, already
gathered at each token's position id (``plyx.kernel.rope_tables`` builds them),
with ``R <= Dh`` (partial rotary leaves dims ``R..Dh`` untouched).

Pair ``i`` (``0 <= i < R/2``) is ``(x[i], x[i + R/2])`` in the rotate-half layout
(Llama / Hugging Face) and ``(x[2i], x[2i+1])`` in the interleaved layout (GPT-J,
Meta's original Llama). Each pair is rotated by the angle ``theta_i``::

    out_a = a * cos - b * sin
    out_b = b * cos + a * sin

The backward is the rotation by ``-theta``: ``da = ga*cos + gb*sin``, ``db = gb*cos - ga*sin``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["rope", "check_rope", "complex_tables", "half_tables", "rotate", "rotate_pair"]


def check_rope(kernel: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Validate and return R, the number of rotated dims."""
    check_float(kernel, "x", x)
    check_float(kernel, "cos", cos)
    check_float(kernel, "sin", sin)
    check_same_device(kernel, ("x", x), ("cos", cos), ("sin", sin))
    if x.dim() != 4:
        raise KernelInputError(kernel, "x", f"expected [B, T, H, Dh], got shape {shape_str(x.shape)}",
                               "view the projection as (B, T, n_heads, head_dim)")
    b, t, _, dh = x.shape
    if cos.shape != sin.shape:
        raise KernelInputError(kernel, "sin", f"shape {shape_str(sin.shape)} differs from cos's {shape_str(cos.shape)}",
                               "build both with plyx.kernel.rope_tables")
    ok = (cos.dim() == 2 and cos.shape[0] == t) or (cos.dim() == 3 and cos.shape[0] in (1, b) and cos.shape[1] == t)
    if not ok:
        raise KernelInputError(kernel, "cos", f"expected [T={t}, R/2] or [B={b}, T={t}, R/2], got {shape_str(cos.shape)}",
                               "gather the tables at the position ids of x's tokens (plyx.kernel.rope_tables)")
    rotary = 2 * cos.shape[-1]
    if rotary == 0 or rotary > dh:
        raise KernelInputError(kernel, "cos", f"last dim {cos.shape[-1]} means R={rotary} rotated dims, expected 1 <= R/2 and R <= Dh={dh}",
                               "build the tables with rotary_dim <= head_dim")
    return rotary


#: ``half_tables``' results for the last few (cos, sin) tensor objects: a model that passes the same cached
#: tables every step (``TransformerLM`` for default positions) builds the layout once, not twice per layer
_HALF_CACHE: dict[tuple[Any, ...], tuple[Any, Any, int, int, Any]] = {}
_HALF_CACHE_SIZE = 8
#: tables larger than this (elements of cos) are not kept: per-batch inference tables, long prefills
_HALF_CACHE_NUMEL = 1 << 16


def half_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, heads: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotate-half layout's tables over all R dims, ``(B|1, T, heads, R)``: ``[cos, cos]`` and ``[-sin, sin]``,
    so that ``rope(x) = x * C + swap(x) * S`` (``swap`` exchanges the halves: ``[b, a]``).

    ``heads > 1`` repeats them over a head axis (contiguous; remembered ``[T, R/2]`` tables only): x's heads then
    meet a table of their own layout, so the products run over whole rows instead of broadcasting per head
    (a third less time at nanoGPT's CPU recipe, issue 20).

    Remembered per (cos, sin) tensor objects while they live unmodified (their version counters), outside
    tracing and for tables that do not require grad; any other call computes them.
    """
    if cos.dim() == 3 or not _cacheable(cos, sin, heads):
        heads = 1  # per-row tables, or built for this call only: broadcast over the heads, no copy

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        c = (cos if cos.dim() == 3 else cos[None]).to(dtype)  # (B|1, T, R/2)
        s = (sin if sin.dim() == 3 else sin[None]).to(dtype)
        tables = torch.cat((c, c), dim=-1)[:, :, None, :], torch.cat((-s, s), dim=-1)[:, :, None, :]
        if heads > 1:
            return tuple(t.expand(-1, -1, heads, -1).contiguous() for t in tables)  # type: ignore[return-value]
        return tables

    return _remembered(cos, sin, (dtype, heads), build)  # type: ignore[no-any-return]


def complex_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The interleaved layout's rotation as complex numbers ``cos + i sin``, ``(B|1, T, 1, R/2)`` of ``dtype``'s
    complex type: pair ``(x[2i], x[2i+1])`` read as ``x[2i] + i x[2i+1]`` is rotated by one complex product
    (Meta's original Llama). Remembered as ``half_tables``' tables are."""
    def build() -> torch.Tensor:
        c = (cos if cos.dim() == 3 else cos[None]).to(dtype)  # (B|1, T, R/2)
        s = (sin if sin.dim() == 3 else sin[None]).to(dtype)
        return torch.complex(c, s)[:, :, None, :]

    return _remembered(cos, sin, (dtype, "complex"), build)  # type: ignore[no-any-return]


def _cacheable(cos: torch.Tensor, sin: torch.Tensor, heads: int = 1) -> bool:
    return not (cos.requires_grad or sin.requires_grad or cos.is_inference() or sin.is_inference()
                or cos.numel() * heads > _HALF_CACHE_NUMEL or torch.compiler.is_compiling())


def _remembered(cos: torch.Tensor, sin: torch.Tensor, what: tuple[Any, ...], build: Any) -> Any:
    """``build()``, remembered per (cos, sin) tensor objects and ``what`` while they live unmodified."""
    if not _cacheable(cos, sin, what[1] if isinstance(what[1], int) else 1):
        return build()
    key = (id(cos), id(sin), *what)
    hit = _HALF_CACHE.get(key)
    if hit is not None and hit[0]() is cos and hit[1]() is sin and hit[2] == cos._version and hit[3] == sin._version:
        return hit[4]
    tables = build()
    if len(_HALF_CACHE) >= _HALF_CACHE_SIZE:
        del _HALF_CACHE[next(iter(_HALF_CACHE))]  # the oldest entry
    # the entry goes with the tables it was derived from: no derived tables outlive their cos
    _HALF_CACHE[key] = (weakref.ref(cos, lambda _ref, key=key: _HALF_CACHE.pop(key, None)), weakref.ref(sin),
                        cos._version, sin._version, tables)
    return tables


def rotate(x: torch.Tensor, rotary: int, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of ``x``'s first ``rotary`` dims with ``half_tables``' ``(C, S)``, in their dtype.

    ``x * C + swap(x) * S`` is ``(a cos - b sin, b cos + a sin)`` in three ops (a multiply, the halves'
    swap and one fused multiply-add), forward and backward: on CPU, where each op is a pass over q or k, about half the
    time of the halves' four products, two sums and concatenations (nanoGPT's CPU recipe, issue 20).
    """
    C, S = tables
    full = rotary == x.shape[-1]
    xr = (x if full else x[..., :rotary]).to(C.dtype)  # (B, T, H, R)
    half = rotary // 2
    # the swap as two slices and a concatenation, not ``roll``: onnxscript 0.6's slice rewrite rule crashes on
    # the ONNX lowering of ``roll`` (the oldest-resolution export tests), and both are one copy on CPU
    swapped = torch.cat((xr[..., half:], xr[..., :half]), dim=-1)
    out = torch.addcmul(xr * C, swapped, S).to(x.dtype)
    return out if full else torch.cat((out, x[..., rotary:]), dim=-1)  # partial rotary: the rest unchanged


def _turn(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``x * C + swap(x) * S`` over all of x's last dim in one new tensor: a product, then the halves' two
    multiply-adds in place (``swap`` read as slices of x, never copied)."""
    half = x.shape[-1] // 2
    out = x * C  # (B, T, H, R)
    out[..., :half].addcmul_(x[..., half:], S[..., :half])
    out[..., half:].addcmul_(x[..., :half], S[..., half:])
    return out


class _Rotate(torch.autograd.Function):
    """Rotate-half RoPE of q and k (all their dims, in the tables' dtype) and its backward, the rotation by
    ``-theta``: ``dx = g * C + swap(g * S)``, i.e. ``_turn(g, C, swap(S))``.

    Autograd through ``x * C + cat(b, a) * S`` allocated seven tensors per rotated input in the backward
    (the concatenation's slices come back as zero-filled copies); this takes one per input each way
    (nanoGPT's CPU recipe, issue 20). Once differentiable.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, C: torch.Tensor, S: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(C, S)
        return _turn(q, C, S), _turn(k, C, S)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple[Any, ...]:
        C, S = ctx.saved_tensors
        half = S.shape[-1] // 2
        back = torch.cat((S[..., half:], S[..., :half]), dim=-1)  # swap(S) = [s, -s]: the inverse rotation
        gq = _turn(dq, C, back) if dq is not None and ctx.needs_input_grad[0] else None
        gk = _turn(dk, C, back) if dk is not None and ctx.needs_input_grad[1] else None
        return gq, gk, None, None


class _RotateOne(torch.autograd.Function):
    """``_Rotate`` for one tensor (q and k side by side, ``[B, T, H + KV, Dh]``): one product and two multiply-adds
    each way. Once differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(C, S)
        return _turn(x, C, S)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dx: torch.Tensor) -> tuple[Any, ...]:
        C, S = ctx.saved_tensors
        half = S.shape[-1] // 2
        back = torch.cat((S[..., half:], S[..., :half]), dim=-1)  # swap(S) = [s, -s]: the inverse rotation
        return _turn(dx, C, back), None, None


def rotate_pair(q: torch.Tensor, k: torch.Tensor, rotary: int, tables: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotate(q, ...), rotate(k, ...))``: when both are rotated over all their dims in the tables' dtype and a
    gradient is wanted, through ``_Rotate`` (one allocation per tensor each way); otherwise ``rotate`` on each."""
    C, S = tables
    if (rotary == q.shape[-1] and q.dtype == k.dtype == C.dtype and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad) and not torch.compiler.is_compiling()):
        return _Rotate.apply(q, k, C, S)
    return rotate(q, rotary, tables), rotate(k, rotary, tables)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    rotary = check_rope("rope:reference", x, cos, sin)
    compute = torch.promote_types(x.dtype, torch.float32)
    if not interleaved:
        if (rotary == x.shape[-1] and x.dtype == compute and torch.is_grad_enabled() and x.requires_grad
                and not torch.compiler.is_compiling()):
            # a training step (CPU: q and k of a stacked projection together): the tables per head, one Function
            return _RotateOne.apply(x, *half_tables(cos, sin, compute, heads=x.shape[2]))
        return rotate(x, rotary, half_tables(cos, sin, compute))
    if (rotary == x.shape[-1] and x.dtype == compute and not torch.compiler.is_compiling()
            and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1]) and x.stride(-1) == 1):
        # pairs as complex numbers: one complex product each way (the stacked ops below take six and a stack)
        pairs = torch.view_as_complex(x.unflatten(-1, (rotary // 2, 2)))  # (B, T, H, R/2) complex, a view of x
        return torch.view_as_real(pairs * complex_tables(cos, sin, compute)).flatten(-2)
    c = (cos if cos.dim() == 3 else cos[None]).to(compute)[:, :, None, :]  # (B|1, T, 1, R/2)
    s = (sin if sin.dim() == 3 else sin[None]).to(compute)[:, :, None, :]
    xr = x[..., :rotary].to(compute)  # (B, T, H, R)
    a, b = xr[..., 0::2], xr[..., 1::2]
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., rotary:]), dim=-1)
