"""Triton cross-entropy (ignore_index, label smoothing, z-loss, argmax).

``cross_entropy`` reads the logits once in the forward (loss and lse, ``ce_rows`` without ``dz``) and once in
the backward (``ce_grad``: dz from the saved lse, times the incoming gradient read on the device): two reads
and one write of ``[N, V]``, no host sync. The fused linear cross-entropy instead computes the gradient in
its forward pass (``ce_rows`` with ``dz``, over its logits chunk in place), where one program per row streams
the vocabulary in blocks twice:

1. online softmax: running max m and sum s of exp(z - m), the sum of z (label
   smoothing), the argmax; then ``lse = m + log(s)`` and::

       loss = lse - (1 - eps) * z[t] - (eps / V) * sum(z) + z_loss * lse^2

2. when a gradient is needed, ``dz[j] = scale * (p[j] * (1 + 2 z_loss lse) - eps/V - (1-eps)[j == t])``
   with ``p = exp(z - lse)``, written to DZ, which may be Z itself (the fused
   linear cross-entropy overwrites its logits chunk: each element is read before
   the same program writes it).

``scale`` is 1/n_valid (mean) or 1, read from a device tensor so no host sync
is needed; the fused loss's backward then multiplies by the incoming gradient.
Ignored rows get loss 0 and dz 0.

``cross_entropy(..., inplace=True)`` is the same one-pass gradient over the caller's logits (as Liger-Kernel's
cross-entropy; the caller gives up the logits, which hold ``dL/dz`` afterwards). Its backward multiplies by
the incoming gradient with ``scale_``, whose programs read the gradient on the device and return at once
when it is exactly 1 (``loss.backward()`` passes ``torch.ones_like(loss)``): no host sync, no pass over
``[N, V]``. Bytes per fwd+bwd at the bench shape (8192 x 128256 bf16, 2 GiB of logits)::

    default (lse saved, gradient in the backward)   read 2 GiB + read 2 GiB, write 2 GiB   any incoming g
    inplace (gradient in the forward)               read 4 GiB, write 2 GiB, no new buffer  g == 1
                                                    + read 2 GiB, write 2 GiB             g != 1

Both are at the 6 GiB floor for ``loss.backward()``; the in-place call saves the 2 GiB gradient buffer,
the default is one pass cheaper for a non-unit incoming gradient (the benchmark's random cotangent).

Split-vocabulary forward (no gradient, few rows: greedy decoding's argmax at batch 1). One program per
row leaves most SMs idle while it loops over the whole vocabulary, so the row is cut into S contiguous
chunks: ``_ce_split_kernel`` on grid (n, S) reduces chunk j to partials ``m_j`` (max), ``s_j = sum
exp(z - m_j)``, ``zsum_j`` and the chunk's first argmax ``i_j`` (its best value is ``m_j``); then
``_ce_combine_kernel`` on grid (n,) merges them::

    M = max_j m_j      lse = M + log(sum_j s_j exp(m_j - M))      zsum = sum_j zsum_j
    argmax = i_j of the lowest j with m_j == M  (chunks are in column order: the lowest index wins)

and writes loss and lse with the formula above. Both launches have fixed shapes (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.cross_entropy import check_cross_entropy, reduce_loss
from plyx.kernel.triton_ops._common import empty, interpreting, next_power_of_2, num_programs, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs

__all__ = ["ce_grad", "ce_rows", "cross_entropy", "cross_entropy_backward", "cross_entropy_saving", "scale_"]

_NAME = "cross_entropy:triton"


@triton.jit
def _stream_row(zrow, lo, hi, V, BLOCK: tl.constexpr, HAS_ARGMAX: tl.constexpr):
    """Online softmax over columns [lo, hi) of one row: (max m, sum exp(z - m), sum z, first argmax)."""
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    zsum = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(lo, hi, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(zrow + idx, mask=mask, other=-float("inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        new_m = tl.maximum(m, block_max)
        # while every column so far is -inf (masked logits), exp(-inf - -inf) would be NaN: shift by 0 instead
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = new_m
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if HAS_ARGMAX:
            block_idx = tl.argmax(z, axis=0)
            better = block_max > best  # strict: the first maximum wins, as torch.argmax
            best_idx = tl.where(better, start + block_idx, best_idx)
            best = tl.where(better, block_max, best)
    return m, s, zsum, best_idx


@triton.jit
def _store_row_grad(zrow, dzrow, V, lse, safe, scale, eps, z_loss, BLOCK: tl.constexpr):
    """One pass over a row: ``dz = scale * dL/dz`` of the smoothed, z-regularised loss, from the row's lse
    (``safe``: the target column; ``scale`` 0 on an ignored row)."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(zrow + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        dz = p * (1.0 + 2.0 * z_loss * lse) - eps / V - tl.where(idx == safe, 1.0 - eps, 0.0)
        tl.store(dzrow + idx, (dz * scale).to(dzrow.dtype.element_ty), mask=mask)


@triton.jit
def _ce_kernel(Z, stride_z, T, SCALE, LOSS, LSE, ARGMAX, DZ, stride_dz, V, ignore_index, eps, z_loss,
               HAS_GRAD: tl.constexpr, HAS_ARGMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zrow = Z + row * stride_z
    m, s, zsum, best_idx = _stream_row(zrow, 0, V, V, BLOCK, HAS_ARGMAX)
    lse = m + tl.log(s)
    target = tl.load(T + row)
    valid = target != ignore_index
    safe = tl.where(valid, target, 0)
    zt = tl.load(zrow + safe).to(tl.float32)
    loss = lse - (1.0 - eps) * zt - (eps / V) * zsum + z_loss * lse * lse
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)
    if HAS_ARGMAX:
        tl.store(ARGMAX + row, best_idx.to(tl.int64))
    if HAS_GRAD:
        scale = tl.load(SCALE).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        dzrow = DZ + row * stride_dz
        _store_row_grad(zrow, dzrow, V, lse, safe, scale, eps, z_loss, BLOCK)


@triton.jit
def _ce_grad_kernel(Z, stride_z, T, LSE, G, stride_g, SCALE, DZ, stride_dz, V, ignore_index, eps, z_loss,
                    BLOCK: tl.constexpr):
    """The backward, one program per row, one pass over the row: ``dz = g * scale * dL/dz`` from the forward's
    lse (``g``: the incoming gradient, one per row or one for all: ``stride_g`` 0)."""
    row = tl.program_id(0).to(tl.int64)
    zrow = Z + row * stride_z
    dzrow = DZ + row * stride_dz
    target = tl.load(T + row)
    valid = target != ignore_index
    safe = tl.where(valid, target, 0)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE).to(tl.float32) * tl.load(G + row * stride_g).to(tl.float32)
    scale = tl.where(valid, scale, 0.0)
    _store_row_grad(zrow, dzrow, V, lse, safe, scale, eps, z_loss, BLOCK)


@triton.jit
def _scale_kernel(X, stride_x, C, G, stride_g, BLOCK: tl.constexpr):
    """Program per row: ``x *= g`` (float32 product, stored in x's dtype), nothing when ``g`` is exactly 1;
    ``g`` one per row or one for all (``stride_g`` 0), read here so the host never looks at it."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(G + row * stride_g).to(tl.float32)
    if g != 1.0:
        xrow = X + row * stride_x
        cols = tl.arange(0, BLOCK)
        for start in range(0, C, BLOCK):
            idx = start + cols
            mask = idx < C
            x = tl.load(xrow + idx, mask=mask, other=0.0).to(tl.float32)
            tl.store(xrow + idx, (x * g).to(xrow.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``x *= grad`` in place for ``x [R, C]`` (unit column stride) and ``grad`` 0-dim (or one element) or
    ``[R]`` (one per row), on the device: each program returns at once when its factor is exactly 1.0, so
    ``loss.backward()``'s incoming 1 costs one tiny launch instead of a read and write of ``x``. Returns x."""
    r, c = x.shape
    if r and c:
        per_row = grad.dim() > 0 and grad.numel() == r and r > 1
        g = grad.reshape(-1)
        if g.dtype != torch.float32:
            g = g.float()
        block, warps = _launch_config(c)
        _scale_kernel[(r,)](x, x.stride(0), c, g, 1 if per_row else 0, BLOCK=block, num_warps=warps)
    return x


def ce_grad(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor, *,
            ignore_index: int, eps: float, z_loss: float) -> torch.Tensor:
    """``dL/dz`` ``[n, V]`` in z's dtype from the forward's ``lse`` [n] and the incoming gradient ``grad`` (0-dim,
    or [n] per row), times ``scale`` (``row_scale``): one read of the logits and one write, no host sync."""
    n, v = z.shape
    dz = empty((n, v), dtype=z.dtype, device=z.device)
    if n:
        g = grad.reshape(-1) if grad.dim() else grad.reshape(1)
        block, warps = _launch_config(v)
        _ce_grad_kernel[(n,)](z, z.stride(0), targets, lse, g, 1 if grad.dim() else 0, scale, dz, dz.stride(0), v,
                              int(ignore_index), float(eps), float(z_loss), BLOCK=block, num_warps=warps)
    return dz


@triton.jit
def _ce_split_kernel(Z, stride_z, PART, IDX, V, CHUNK, S, HAS_ARGMAX: tl.constexpr, BLOCK: tl.constexpr,
                     USE_GDC: tl.constexpr):
    """Program (row, j): partials of columns [j * CHUNK, (j + 1) * CHUNK) into PART [n, 3, S] (m, s, zsum)
    and IDX [n, S] (first argmax)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    wait_for_inputs(USE_GDC)  # programmatic dependent launch: the logits are the previous kernel's output
    lo = j * CHUNK
    m, s, zsum, best_idx = _stream_row(Z + row * stride_z, lo, tl.minimum(lo + CHUNK, V), V, BLOCK, HAS_ARGMAX)
    part = PART + row * 3 * S + j
    tl.store(part, m)
    tl.store(part + S, s)
    tl.store(part + 2 * S, zsum)
    if HAS_ARGMAX:
        tl.store(IDX + row * S + j, best_idx)


@triton.jit
def _ce_combine_kernel(Z, stride_z, T, PART, IDX, LOSS, LSE, ARGMAX, V, S, ignore_index, eps, z_loss,
                       HAS_ARGMAX: tl.constexpr, S_BLOCK: tl.constexpr):
    """One program per row merges its S partials (all in one vector) into loss, lse and argmax."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, S_BLOCK)
    live = j < S
    part = PART + row * 3 * S
    m = tl.load(part + j, mask=live, other=-float("inf"))
    s = tl.load(part + S + j, mask=live, other=0.0)
    zsum = tl.sum(tl.load(part + 2 * S + j, mask=live, other=0.0), axis=0)
    big_m = tl.max(m, axis=0)
    # a chunk of only -inf logits has m_j = -inf and s_j = 0: it adds nothing (and no NaN when all are -inf)
    shift = tl.where(big_m == -float("inf"), 0.0, big_m)
    lse = big_m + tl.log(tl.sum(s * tl.exp(m - shift), axis=0))
    target = tl.load(T + row)
    valid = target != ignore_index
    safe = tl.where(valid, target, 0)
    zt = tl.load(Z + row * stride_z + safe).to(tl.float32)
    loss = lse - (1.0 - eps) * zt - (eps / V) * zsum + z_loss * lse * lse
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    tl.store(LSE + row, lse)
    if HAS_ARGMAX:
        idx = tl.load(IDX + row * S + j, mask=live, other=0)
        # each chunk's own index is its first maximum, and chunks run in column order: the smallest index
        # among the chunks holding the row's maximum is torch.argmax's (strict > over j in order)
        first = tl.min(tl.where(live & (m == big_m), idx, V), axis=0)
        tl.store(ARGMAX + row, first.to(tl.int64))


#: (columns per step, warps) on CUDA; the interpreter uses 256 columns. Measured on an H100 at
#: 8192 x 128256 (bench/results, 2026-11-22): 2048/4 0.78 ms, 8192/16 0.85 ms, 32768/32 0.95 ms forward:
#: small programs keep more rows in flight per SM
LAUNCH = {"block": 2048, "warps": 4}


def _launch_config(v: int) -> tuple[int, int]:
    if interpreting():
        return min(next_power_of_2(v), 256), 4
    block = min(next_power_of_2(v), LAUNCH["block"])
    return block, (LAUNCH["warps"] if block >= LAUNCH["block"] else 4)


#: split-vocabulary forward (no gradient, few rows): about ``per_sm`` programs per SM over all rows, each
#: streaming a chunk of the row in ``block`` columns (``warps`` warps); the interpreter pretends to have
#: ``interpreter_programs`` and uses ``interpreter_block`` so small test vocabularies split too.
#: Untuned; on an H200 it took the 32000-token greedy argmax of a decode step from ~23 to ~6 us.
SPLIT = {"per_sm": 2, "block": 1024, "warps": 4, "interpreter_programs": 8, "interpreter_block": 16}


def _split_plan(device: torch.device, n: int, v: int, splits: int | None) -> tuple[int, int, int]:
    """``(S, chunk, block)``: S chunks of ``chunk`` columns (a multiple of ``block``, the last one partial);
    S is ``splits`` when given, else enough to give about ``SPLIT["per_sm"]`` programs per SM."""
    if interpreting() or device.type != "cuda":
        block = min(next_power_of_2(v), SPLIT["interpreter_block"])
        programs = SPLIT["interpreter_programs"]
    else:
        block = min(next_power_of_2(v), SPLIT["block"])
        programs = num_programs(device, 1 << 30, per_sm=SPLIT["per_sm"])  # SM count, read once per device
    want = splits if splits is not None else programs // max(n, 1)
    want = max(1, min(want, triton.cdiv(v, block)))
    chunk = triton.cdiv(triton.cdiv(v, want), block) * block
    return triton.cdiv(v, chunk), chunk, block


def ce_rows(z: torch.Tensor, targets: torch.Tensor, *, ignore_index: int, eps: float, z_loss: float,
            scale: torch.Tensor | None, dz: torch.Tensor | None, argmax: bool = False,
            splits: int | None = None) -> tuple[torch.Tensor, ...]:
    """Per-row loss and lse of logits ``z [n, V]`` (float32); writes ``scale * dL/dz`` to ``dz`` when given.

    Returns ``(loss_rows, lse)`` plus ``argmax`` [n] when asked. Without ``dz``, when ``SPLIT["per_sm"]``
    programs per SM leave at least 2 per row (n <= the SM count), each row is cut into chunks reduced by
    separate programs, then combined (see the module docstring). ``splits`` forces the number of chunks (at most; 1 is the one-program-per-row
    kernel; only without ``dz``): for tests and benchmarks.
    """
    if splits is not None and (splits < 1 or (dz is not None and splits != 1)):
        raise ValueError(f"ce_rows: splits={splits} must be >= 1, and 1 (or None) when a gradient `dz` is written; "
                         "the split-vocabulary path is forward-only")
    n, v = z.shape
    loss = empty((n,), dtype=torch.float32, device=z.device)
    lse = empty((n,), dtype=torch.float32, device=z.device)
    am = empty((n,), dtype=torch.int64, device=z.device) if argmax else loss
    if not n:
        return (loss, lse, am) if argmax else (loss, lse)
    if dz is None:
        n_splits, chunk, block = _split_plan(z.device, n, v, splits)
        if n_splits > 1:
            _ce_split(z, targets, loss, lse, am, ignore_index, eps, z_loss, argmax, n_splits, chunk, block)
            return (loss, lse, am) if argmax else (loss, lse)
    block, warps = _launch_config(v)
    _ce_kernel[(n,)](z, z.stride(0), targets, scale if scale is not None else lse, loss, lse, am,
                     dz if dz is not None else z, dz.stride(0) if dz is not None else 0, v, ignore_index,
                     float(eps), float(z_loss), HAS_GRAD=dz is not None, HAS_ARGMAX=argmax, BLOCK=block,
                     num_warps=warps)
    return (loss, lse, am) if argmax else (loss, lse)


def _ce_split(z: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor, am: torch.Tensor,
              ignore_index: int, eps: float, z_loss: float, argmax: bool, n_splits: int, chunk: int,
              block: int) -> None:
    """The two launches of the split-vocabulary forward; partials live in small scratch tensors."""
    n, v = z.shape
    part = torch.empty((n, 3, n_splits), dtype=torch.float32, device=z.device)  # m, s, zsum per chunk
    idx = torch.empty((n, n_splits), dtype=torch.int32, device=z.device) if argmax else part
    gdc = pdl(z.device)
    _ce_split_kernel[(n, n_splits)](z, z.stride(0), part, idx, v, chunk, n_splits, HAS_ARGMAX=argmax, BLOCK=block,
                                    USE_GDC=gdc, num_warps=SPLIT["warps"], launch_pdl=gdc)
    _ce_combine_kernel[(n,)](z, z.stride(0), targets, part, idx, loss, lse, am, v, n_splits, ignore_index,
                             float(eps), float(z_loss), HAS_ARGMAX=argmax, S_BLOCK=next_power_of_2(n_splits),
                             num_warps=1 if n_splits <= 32 else 4)


def row_scale(valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """The per-row gradient factor as a 1-element device tensor: 1/n_valid for mean, else 1 (no host sync)."""
    if reduction == "mean":
        return 1.0 / valid.sum().clamp(min=1).to(torch.float32).reshape(1)
    return torch.ones(1, dtype=torch.float32, device=valid.device)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, eps: float, z_loss: float,
                reduction: str, argmax: bool, grad: bool, inplace: bool) -> Any:
        # per-row losses without a gradient (greedy decoding's argmax) need no mask: one launch fewer
        valid = targets != ignore_index if grad or reduction != "none" else targets
        ctx.inplace = grad and inplace
        if ctx.inplace:
            # one pass: loss and scale * dL/dz over the logits (the caller gave them up); the backward only
            # scales by the incoming gradient. reduction "none": per-row factors arrive there, scale 1 here
            scale = row_scale(valid, reduction)
            out = ce_rows(logits, targets, ignore_index=ignore_index, eps=eps, z_loss=z_loss, scale=scale, dz=logits,
                          argmax=argmax)
            ctx.save_for_backward(logits)
            ctx.used = False
        else:
            out = ce_rows(logits, targets, ignore_index=ignore_index, eps=eps, z_loss=z_loss, scale=None, dz=None,
                          argmax=argmax)
        loss = reduce_loss(out[0], valid, reduction)
        if grad and not inplace:  # the backward's one pass reads the logits and this lse (no sync, no extra pass)
            ctx.save_for_backward(logits, targets, out[1], row_scale(valid, reduction))
            ctx.options = (ignore_index, eps, z_loss)
        if argmax:
            ctx.mark_non_differentiable(out[2])
            return loss, out[2]
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        none = (None,) * 8
        if ctx.inplace:
            if ctx.used:
                raise RuntimeError("cross_entropy:triton: backward ran twice on one inplace=True forward "
                                   "(retain_graph=True); the gradient is scaled in place, so call the loss again "
                                   "or use inplace=False")
            ctx.used = True
            (dz,) = ctx.saved_tensors
            return (scale_(dz, grad), *none)
        logits, targets, lse, scale = ctx.saved_tensors
        ignore_index, eps, z_loss = ctx.options
        dz = ce_grad(logits, targets, lse, grad, scale, ignore_index=ignore_index, eps=eps, z_loss=z_loss)
        return (dz, *none)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    return_argmax: bool = False,
    inplace: bool = False,
) -> Any:
    """Triton cross-entropy; same contract as ``plyx.kernel.reference.cross_entropy``.

    Target ids outside ``[0, V)`` other than ``ignore_index`` are not checked (that would sync the host).

    Args:
        inplace: when a gradient is needed, compute it in the forward's one pass and write it over ``logits``
            (Liger-Kernel's scheme: no ``[N, V]`` gradient buffer; the caller must not read the logits
            afterwards, and the backward can run once). Without a gradient it changes nothing.
    """
    check_cross_entropy(_NAME, logits, targets, ignore_index, label_smoothing, z_loss, reduction, check_values=False)
    check_last_dim_contiguous(_NAME, "logits", logits)
    # forward() runs with grad mode off, so whether a gradient will be needed is decided here
    grad = torch.is_grad_enabled() and logits.requires_grad
    return _CrossEntropy.apply(logits, targets, int(ignore_index), float(label_smoothing), float(z_loss), reduction,
                               bool(return_argmax), grad, bool(inplace))


def cross_entropy_saving(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse [N] float32)``: the forward of ``plyx::cross_entropy``'s custom op, whose backward is
    ``cross_entropy_backward`` (one pass, as the autograd Function's)."""
    check_cross_entropy(_NAME, logits, targets, ignore_index, label_smoothing, z_loss, reduction, check_values=False)
    check_last_dim_contiguous(_NAME, "logits", logits)
    valid = targets != ignore_index
    rows, lse = ce_rows(logits, targets, ignore_index=int(ignore_index), eps=float(label_smoothing),
                        z_loss=float(z_loss), scale=None, dz=None)
    return reduce_loss(rows, valid, reduction), lse


def cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, *,
                           ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                           reduction: str = "mean") -> torch.Tensor:
    """``dL/dlogits`` for the incoming ``grad`` from ``cross_entropy_saving``'s lse."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    scale = row_scale(targets != ignore_index, reduction)
    return ce_grad(logits, targets, lse, grad, scale, ignore_index=int(ignore_index), eps=float(label_smoothing),
                   z_loss=float(z_loss))
