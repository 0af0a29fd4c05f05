"""Triton cross-entropy (ignore_index, label smoothing, z-loss, argmax), gradient computed in the forward pass.

One program per row streams the vocabulary in blocks twice:

1. online softmax: running max m and sum s of exp(z - m), the sum of z (label
   smoothing), the argmax; then ``lse = m + log(s)`` and::

       loss = lse - (1 - eps) * z[t] - (eps / V) * sum(z) + z_loss * lse^2

2. when a gradient is needed, ``dz[j] = scale * (p[j] * (1 + 2 z_loss lse) - eps/V - (1-eps)[j == t])``
   with ``p = exp(z - lse)``, written to DZ, which may be Z itself (the fused
   linear cross-entropy overwrites its logits chunk: each element is read before
   the same program writes it).

``scale`` is 1/n_valid (mean) or 1, read from a device tensor so no host sync
is needed; the autograd backward then multiplies by the incoming gradient.
Ignored rows get loss 0 and dz 0.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.cross_entropy import check_cross_entropy, reduce_loss
from plyx.kernel.triton_ops._common import empty, interpreting, next_power_of_2

__all__ = ["cross_entropy", "ce_rows"]

_NAME = "cross_entropy:triton"


@triton.jit
def _ce_kernel(Z, stride_z, T, SCALE, LOSS, LSE, ARGMAX, DZ, stride_dz, V, ignore_index, eps, z_loss,
               HAS_GRAD: tl.constexpr, HAS_ARGMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zrow = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    zsum = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(zrow + idx, mask=mask, other=-float("inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        new_m = tl.maximum(m, block_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
        m = new_m
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if HAS_ARGMAX:
            block_idx = tl.argmax(z, axis=0)
            better = block_max > best  # strict: the first maximum wins, as torch.argmax
            best_idx = tl.where(better, start + block_idx, best_idx)
            best = tl.where(better, block_max, best)
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
        for start in range(0, V, BLOCK):
            idx = start + cols
            mask = idx < V
            z = tl.load(zrow + idx, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            dz = p * (1.0 + 2.0 * z_loss * lse) - eps / V - tl.where(idx == safe, 1.0 - eps, 0.0)
            tl.store(dzrow + idx, (dz * scale).to(DZ.dtype.element_ty), mask=mask)


#: (columns per step, warps) on CUDA; the interpreter uses 256 columns. Measured on an H100 at
#: 8192 x 128256 (bench/results, 2026-11-22): 2048/4 0.78 ms, 8192/16 0.85 ms, 32768/32 0.95 ms forward:
#: small programs keep more rows in flight per SM
LAUNCH = {"block": 2048, "warps": 4}


def _launch_config(v: int) -> tuple[int, int]:
    if interpreting():
        return min(next_power_of_2(v), 256), 4
    block = min(next_power_of_2(v), LAUNCH["block"])
    return block, (LAUNCH["warps"] if block >= LAUNCH["block"] else 4)


def ce_rows(z: torch.Tensor, targets: torch.Tensor, *, ignore_index: int, eps: float, z_loss: float,
            scale: torch.Tensor | None, dz: torch.Tensor | None, argmax: bool = False) -> tuple[torch.Tensor, ...]:
    """Per-row loss and lse of logits ``z [n, V]`` (float32); writes ``scale * dL/dz`` to ``dz`` when given.

    Returns ``(loss_rows, lse)`` plus ``argmax`` [n] when asked.
    """
    n, v = z.shape
    loss = empty((n,), dtype=torch.float32, device=z.device)
    lse = empty((n,), dtype=torch.float32, device=z.device)
    am = empty((n,), dtype=torch.int64, device=z.device) if argmax else loss
    block, warps = _launch_config(v)
    if n:
        _ce_kernel[(n,)](z, z.stride(0), targets, scale if scale is not None else lse, loss, lse, am,
                         dz if dz is not None else z, dz.stride(0) if dz is not None else 0, v, ignore_index,
                         float(eps), float(z_loss), HAS_GRAD=dz is not None, HAS_ARGMAX=argmax, BLOCK=block,
                         num_warps=warps)
    return (loss, lse, am) if argmax else (loss, lse)


def row_scale(valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """The per-row gradient factor as a 1-element device tensor: 1/n_valid for mean, else 1 (no host sync)."""
    if reduction == "mean":
        return 1.0 / valid.sum().clamp(min=1).to(torch.float32).reshape(1)
    return torch.ones(1, dtype=torch.float32, device=valid.device)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, eps: float, z_loss: float,
                reduction: str, argmax: bool, grad: bool) -> Any:
        valid = targets != ignore_index
        dz = empty(logits.shape, dtype=logits.dtype, device=logits.device) if grad else None
        out = ce_rows(logits, targets, ignore_index=ignore_index, eps=eps, z_loss=z_loss,
                      scale=row_scale(valid, reduction) if grad else None, dz=dz, argmax=argmax)
        loss = reduce_loss(out[0], valid, reduction)
        ctx.save_for_backward(dz if grad else None)
        ctx.used = False
        if argmax:
            ctx.mark_non_differentiable(out[2])
            return loss, out[2]
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        (dz,) = ctx.saved_tensors
        if ctx.used:
            raise RuntimeError("cross_entropy:triton: backward ran twice on one forward (retain_graph=True); its "
                               "gradient buffer is scaled in place, so call the loss again instead")
        ctx.used = True
        # dz holds dL/dz for an incoming gradient of 1: scale it in place by the actual one (per row for
        # reduction="none"); loss.backward() passes exactly 1, which needs no pass over [N, V] at all
        if grad.dim():
            dz.mul_(grad[:, None].to(dz.dtype))
        elif not bool(grad == 1):  # one host sync instead of a read and write of the whole gradient
            dz.mul_(grad.to(dz.dtype))
        return dz, None, None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    return_argmax: bool = False,
) -> Any:
    """Triton cross-entropy; same contract as ``plyx.kernel.reference.cross_entropy``.

    Target ids outside ``[0, V)`` other than ``ignore_index`` are not checked (that would sync the host).
    """
    check_cross_entropy(_NAME, logits, targets, ignore_index, label_smoothing, z_loss, reduction, check_values=False)
    check_last_dim_contiguous(_NAME, "logits", logits)
    # forward() runs with grad mode off, so whether a gradient will be needed is decided here
    grad = torch.is_grad_enabled() and logits.requires_grad
    return _CrossEntropy.apply(logits, targets, int(ignore_index), float(label_smoothing), float(z_loss), reduction,
                               bool(return_argmax), grad)
