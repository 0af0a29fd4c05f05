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

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["rope", "check_rope", "half_tables", "rotate"]


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


def half_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotate-half layout's tables over all R dims, ``(B|1, T, 1, R)``: ``[cos, cos]`` and ``[-sin, sin]``,
    so that ``rope(x) = x * C + swap(x) * S`` (``swap`` exchanges the halves: ``[b, a]``)."""
    c = (cos if cos.dim() == 3 else cos[None]).to(dtype)  # (B|1, T, R/2)
    s = (sin if sin.dim() == 3 else sin[None]).to(dtype)
    return torch.cat((c, c), dim=-1)[:, :, None, :], torch.cat((-s, s), dim=-1)[:, :, None, :]


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


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    rotary = check_rope("rope:reference", x, cos, sin)
    compute = torch.promote_types(x.dtype, torch.float32)
    if not interleaved:
        return rotate(x, rotary, half_tables(cos, sin, compute))
    c = (cos if cos.dim() == 3 else cos[None]).to(compute)[:, :, None, :]  # (B|1, T, 1, R/2)
    s = (sin if sin.dim() == 3 else sin[None]).to(compute)[:, :, None, :]
    xr = x[..., :rotary].to(compute)  # (B, T, H, R)
    a, b = xr[..., 0::2], xr[..., 1::2]
    out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., rotary:]), dim=-1)
