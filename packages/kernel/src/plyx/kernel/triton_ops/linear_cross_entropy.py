"""Fused linear cross-entropy: cuBLAS lm-head chunk by chunk + the Triton cross-entropy kernel.

Never holds the ``[N, V]`` logits. For each chunk of ``C`` token rows::

    z   = hidden[c] @ W^T (+ b)          [C, V] in the input dtype (one reused buffer)
    dz  = dL/dz, written over z in place (cross_entropy's kernel, scaled by 1/n_valid for mean)
    d_hidden[c] = dz @ W                 [C, D]
    d_weight   += dz^T @ hidden[c]       [V, D]
    d_bias     += sum_rows dz

so the gradients are ready when the forward returns and the backward only
multiplies them by the incoming gradient (in place, on the device: no host sync). Peak
extra memory is ``d_weight + d_hidden + one [C, V] chunk``; ``d_weight`` is
accumulated in float32 for float32 weights and in the weight's dtype otherwise
(as Liger-Kernel does: a float32 accumulator would double the peak).

Why row chunks, and what bounds them (issue 19's goal: <= 40 ms and <= 1,129 MiB at once, at N=8192,
D=4096, V=128256 bf16 on an H100: ~700 TFLOP/s bf16, ~3.0 TB/s). One ``N x V x D`` GEMM is 8.6 TFLOP,
12.3 ms. The memory limit is Liger-Kernel's peak, d_weight (1,002 MiB) + d_hidden (64 MiB) + a
``[256, V]`` chunk (63 MiB): at most 256 rows of logits alive at once.

* Row chunks of C rows (this module): 3 GEMMs, 36.9 ms of compute. Each chunk also reads W twice (z, d_hidden:
  2 x 1 GiB) and reads and writes d_weight once (addmm_'s read-modify-write, 2 x 1 GiB): 4 GiB per chunk.
  C=512 (1,191 MiB): 16 x 4 GiB = 64 GiB, 23 ms, hidden under the compute: floor ~39 ms (measured 47.7-50.5
  ms: cuBLAS's beta=1 epilogue does not overlap its read of d_weight). C=256 (1,129 MiB): 32 x 4 GiB = 128
  GiB, a 46 ms memory floor above the compute (measured 66 ms).
* Two or more row chunks per d_weight pass (one fused GEMM over 2 x 256 rows of d_logits, fp32 accumulation
  before one bf16 read-modify-write): halves the d_weight traffic, but both chunks' d_logits must be alive,
  125 MiB: the memory of C=512.
* Vocabulary slices for the weight gradient (each d_weight slice written once): 4 GEMMs (the logits twice,
  one pass for the row log-sum-exp, one for the gradients), 49 ms of compute alone.

So no schedule meets both at once on this roofline: <= 40 ms needs ~500 rows of d_logits per d_weight pass
(the pass turns compute-bound at K ~ 2 x 4 bytes x 233 FLOP/byte / 4 = 466 rows), which is > 63 MiB. The
chunk is the caller's choice (``chunk_size``): the default 512 rows for time, 256 for Liger's memory.

Without a gradient (eval, or under ``torch.no_grad()``) only the loss is computed,
one chunk at a time. With ``reduction="none"`` the per-row factors only arrive in
the backward, so the forward keeps the inputs and the backward recomputes each
chunk's logits (one extra matmul-equivalent).
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.cross_entropy import reduce_loss
from plyx.kernel.reference.linear_cross_entropy import check_linear_cross_entropy
from plyx.kernel.triton_ops._common import empty
from plyx.kernel.triton_ops.cross_entropy import ce_rows, row_scale, scale_

__all__ = ["linear_cross_entropy", "linear_cross_entropy_with_grads", "default_chunk_rows", "CHUNK_ELEMENTS",
           "SCHEDULE"]

_NAME = "linear_cross_entropy:triton"

#: logits per chunk: 2^26 (128 MiB in bfloat16) gives 512 rows at a 128k vocabulary
CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(n: int, vocab: int, budget: int | None = None) -> int:
    rows = max(1, (budget or CHUNK_ELEMENTS) // max(vocab, 1))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n))


#: ``overlap``: on CUDA, each chunk's d_weight update (memory-bound at 256 rows: a read-modify-write of the
#: whole d_weight) runs on a side stream beside the d_hidden GEMM (compute-bound), both reading the same
#: d_logits chunk; the next chunk waits for both before it overwrites the buffer (no extra memory).
#: Off by default until measured (bench provider ``plyx overlap``).
SCHEDULE = {"overlap": False}


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            ignore_index: int, eps: float, z_loss: float, chunk: int, scale: torch.Tensor | None,
            grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None) -> torch.Tensor:
    """Loss rows [N] (float32); accumulates scaled gradients into ``grads`` when given."""
    n, v = hidden.shape[0], weight.shape[0]
    rows = empty((n,), dtype=torch.float32, device=hidden.device)
    buffer = torch.empty((min(chunk, n), v), dtype=hidden.dtype, device=hidden.device)  # reused for every chunk
    side = (torch.cuda.Stream(hidden.device) if grads is not None and SCHEDULE["overlap"] and hidden.is_cuda
            else None)
    main = torch.cuda.current_stream(hidden.device) if side is not None else None
    for start in range(0, n, chunk):
        h = hidden[start:start + chunk]
        z = buffer[: h.shape[0]]
        if side is not None:
            main.wait_stream(side)  # the previous chunk's d_weight update has read the buffer
        torch.matmul(h, weight.T, out=z)
        if bias is not None:
            z += bias
        if grads is None:
            rows[start:start + h.shape[0]] = ce_rows(z, targets[start:start + chunk], ignore_index=ignore_index,
                                                     eps=eps, z_loss=z_loss, scale=None, dz=None)[0]
            continue
        d_hidden, d_weight, d_bias = grads
        rows[start:start + h.shape[0]] = ce_rows(z, targets[start:start + chunk], ignore_index=ignore_index, eps=eps,
                                                 z_loss=z_loss, scale=scale, dz=z)[0]
        if side is None:
            torch.matmul(z, weight, out=d_hidden[start:start + chunk])  # (C, V) @ (V, D)
            _weight_update(z, h, d_weight, d_bias)
            continue
        side.wait_stream(main)  # d_logits are written
        with torch.cuda.stream(side):
            _weight_update(z, h, d_weight, d_bias)
        torch.matmul(z, weight, out=d_hidden[start:start + chunk])  # beside it on the main stream
    if side is not None:
        main.wait_stream(side)  # d_weight complete before the caller (or the allocator, for the buffer) sees it
    return rows


def _weight_update(z: torch.Tensor, h: torch.Tensor, d_weight: torch.Tensor, d_bias: torch.Tensor | None) -> None:
    """``d_weight += z^T h`` (V, C) @ (C, D) and ``d_bias += sum_rows z`` for one chunk of d_logits ``z``."""
    d_weight.addmm_(z.T.to(d_weight.dtype), h.to(d_weight.dtype))
    if d_bias is not None:
        d_bias += z.sum(0, dtype=torch.float32).to(d_bias.dtype)


def _with_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                ignore_index: int, eps: float, z_loss: float, reduction: str,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, d_hidden, d_weight, d_bias)`` for an incoming gradient of 1 (``reduction`` "mean" or "sum");
    d_weight in float32 for float32 weights, else the weight's dtype; d_bias float32."""
    valid = targets != ignore_index
    acc = torch.float32 if weight.dtype == torch.float32 else weight.dtype
    d_hidden = empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    d_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    rows = _chunks(hidden, weight, bias, targets, ignore_index, eps, z_loss, chunk, row_scale(valid, reduction),
                   (d_hidden, d_weight, d_bias))
    return reduce_loss(rows, valid, reduction), d_hidden, d_weight, d_bias


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                ignore_index: int, eps: float, z_loss: float, reduction: str, chunk: int, grad: bool) -> torch.Tensor:
        valid = targets != ignore_index
        ctx.used = False
        if not grad:
            rows = _chunks(hidden, weight, bias, targets, ignore_index, eps, z_loss, chunk, None, None)
            return reduce_loss(rows, valid, reduction)
        if reduction == "none":
            # per-row factors arrive only in the backward: keep the inputs and recompute there
            rows = _chunks(hidden, weight, bias, targets, ignore_index, eps, z_loss, chunk, None, None)
            ctx.save_for_backward(hidden, weight, bias, targets)
            ctx.options = (ignore_index, eps, z_loss, chunk)
            ctx.recompute = True
            return rows
        loss, d_hidden, d_weight, d_bias = _with_grads(hidden, weight, bias, targets, ignore_index, eps, z_loss,
                                                       reduction, chunk)
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.recompute = False
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.used:
            raise RuntimeError("linear_cross_entropy:triton: backward ran twice on one forward (retain_graph=True); "
                               "its gradients are scaled in place, so call the loss again instead")
        ctx.used = True
        if ctx.recompute:
            hidden, weight, bias, targets = ctx.saved_tensors
            ignore_index, eps, z_loss, chunk = ctx.options
            d_hidden = empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            d_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            n = hidden.shape[0]
            for start in range(0, n, chunk):
                sl = slice(start, start + chunk)
                h = hidden[sl]
                z = torch.matmul(h, weight.T)
                if bias is not None:
                    z += bias
                ce_rows(z, targets[sl], ignore_index=ignore_index, eps=eps, z_loss=z_loss,
                        scale=torch.ones(1, dtype=torch.float32, device=z.device), dz=z)
                z *= grad[sl, None].to(z.dtype)
                torch.matmul(z, weight, out=d_hidden[sl])
                d_weight.addmm_(z.T.float(), h.float())
                if d_bias is not None:
                    d_bias += z.sum(0, dtype=torch.float32)
            return (d_hidden, d_weight.to(weight.dtype), None if bias is None else d_bias.to(bias.dtype),
                    None, None, None, None, None, None, None)
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        # scaled in place (a new tensor would double the peak memory) by the incoming gradient, read on the
        # device: testing it for exactly 1 on the host would be a sync inside the training step (issue 19).
        # scale_'s programs return at once on a factor of exactly 1 (loss.backward()'s): no read-modify-write
        # of d_weight (1 GiB at V=128256, D=4096: ~0.7 ms on an H100) in the common step
        scale_(d_hidden, grad)
        scale_(d_weight, grad)
        if d_bias is not None:
            d_bias.mul_(grad)
        return (d_hidden, d_weight.to(weight_dtype), None if d_bias is None else d_bias.to(bias_dtype),
                None, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Fused lm-head + cross-entropy; same contract as ``plyx.kernel.reference.linear_cross_entropy``.

    ``chunk_size``: token rows per chunk (default: ``CHUNK_ELEMENTS`` logits per chunk).
    """
    check_linear_cross_entropy(_NAME, hidden, weight, targets, bias, ignore_index, label_smoothing, z_loss, reduction,
                               check_values=False)
    check_last_dim_contiguous(_NAME, "hidden", hidden)
    check_last_dim_contiguous(_NAME, "weight", weight)
    chunk = int(chunk_size or default_chunk_rows(hidden.shape[0], weight.shape[0]))
    # forward() runs with grad mode off, so whether gradients will be needed is decided here
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, int(ignore_index), float(label_smoothing),
                                          float(z_loss), reduction, chunk, grad)


def linear_cross_entropy_with_grads(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, bias: torch.Tensor | None = None,
    ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, d_hidden, d_weight, d_bias)``: the loss and its gradients for an incoming gradient of 1, computed
    chunk by chunk in one pass (``reduction`` "mean" or "sum"); gradients in the inputs' dtypes.

    The forward of ``plyx::linear_cross_entropy``'s custom op, whose backward only scales these (the lm-head
    matmuls run once per step, as in the eager call). ``chunk_size``: token rows per chunk (default:
    ``CHUNK_ELEMENTS`` logits per chunk; 256 rows at a 128k vocabulary is Liger-Kernel's memory, see the
    module docstring for the time it costs).
    """
    if reduction == "none":
        raise ValueError("linear_cross_entropy_with_grads: reduction='none' has per-row factors known only in the "
                         "backward; call linear_cross_entropy instead")
    check_linear_cross_entropy(_NAME, hidden, weight, targets, bias, ignore_index, label_smoothing, z_loss, reduction,
                               check_values=False)
    check_last_dim_contiguous(_NAME, "hidden", hidden)
    check_last_dim_contiguous(_NAME, "weight", weight)
    chunk = int(chunk_size or default_chunk_rows(hidden.shape[0], weight.shape[0]))
    loss, d_hidden, d_weight, d_bias = _with_grads(hidden, weight, bias, targets, int(ignore_index),
                                                   float(label_smoothing), float(z_loss), reduction, chunk)
    return (loss, d_hidden, d_weight.to(weight.dtype),
            None if d_bias is None or bias is None else d_bias.to(bias.dtype))
