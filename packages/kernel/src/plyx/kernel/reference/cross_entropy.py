"""``cross_entropy(logits, targets, ...)`` with ignore_index, label smoothing, z-loss and argmax (reference).

Per valid row i (``targets[i] != ignore_index``), with ``lse = logsumexp(z)``::

    loss_i = lse - (1 - eps) * z[t] - (eps / V) * sum_j z[j] + z_loss * lse^2

which is torch's label-smoothed cross-entropy plus PaLM's z-loss. Ignored rows
contribute 0 and are not counted by ``reduction="mean"`` (the mean over zero
valid rows is 0, not NaN, so a fully padded micro-batch is harmless). The loss is
float32 (float64 for float64 logits). ``return_argmax`` also returns
``argmax(logits, -1)`` ``[N]`` (int64): the greedy token of an LM head, for free
in the fused kernel.

Gradient (used by the Triton kernels; here autograd derives it)::

    dz[j] = g_i * (softmax(z)[j] * (1 + 2 * z_loss * lse) - (1 - eps) * [j == t] - eps / V)
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["cross_entropy", "check_cross_entropy", "check_loss_options", "reduce_loss", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


def check_loss_options(kernel: str, label_smoothing: float, z_loss: float, reduction: str) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise KernelInputError(kernel, "label_smoothing", f"must be in [0, 1], got {label_smoothing!r}", "use 0.0 or e.g. 0.1")
    if not z_loss >= 0.0:
        raise KernelInputError(kernel, "z_loss", f"must be >= 0, got {z_loss!r}", "use 0.0 or e.g. 1e-4")
    if reduction not in REDUCTIONS:
        raise KernelInputError(kernel, "reduction", f"must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def check_targets(kernel: str, targets: torch.Tensor, n: int, first: tuple[str, torch.Tensor], *, check_values: bool,
                  vocab: int, ignore_index: int) -> None:
    if not hasattr(targets, "dtype") or targets.dtype not in (torch.int64, torch.int32):
        raise KernelInputError(kernel, "targets", f"expected int64 token ids, got {getattr(targets, 'dtype', type(targets).__name__)}",
                               "cast with `.long()`")
    check_same_device(kernel, first, ("targets", targets))
    if targets.dim() != 1 or targets.shape[0] != n:
        raise KernelInputError(kernel, "targets", f"expected shape [{n}], got {shape_str(targets.shape)}",
                               "flatten targets with `.reshape(-1)` like the logits' rows")
    if check_values and n:
        bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
        if bool(bad.any()):
            value = int(targets[bad][0])
            raise KernelInputError(kernel, "targets", f"holds id {value} outside [0, {vocab}) that is not ignore_index={ignore_index}",
                                   "mask padding with ignore_index")


def check_cross_entropy(kernel: str, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                        label_smoothing: float, z_loss: float, reduction: str, *, check_values: bool) -> None:
    check_float(kernel, "logits", logits)
    if logits.dim() != 2:
        raise KernelInputError(kernel, "logits", f"expected [N, V], got {shape_str(logits.shape)}",
                               "flatten with `.reshape(-1, vocab)`")
    check_targets(kernel, targets, logits.shape[0], ("logits", logits), check_values=check_values,
                  vocab=logits.shape[1], ignore_index=ignore_index)
    check_loss_options(kernel, label_smoothing, z_loss, reduction)


def reduce_loss(rows: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Sum, mean over valid rows (0 when there are none) or per-row losses."""
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1).to(rows.dtype)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    return_argmax: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    check_cross_entropy("cross_entropy:reference", logits, targets, ignore_index, label_smoothing, z_loss, reduction,
                        check_values=True)
    compute = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(compute)  # (N, V)
    lse = torch.logsumexp(z, dim=-1)  # (N,)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    rows = lse - (1.0 - label_smoothing) * z.gather(1, safe[:, None])[:, 0]
    if label_smoothing:
        rows = rows - label_smoothing * z.mean(dim=-1)
    if z_loss:
        rows = rows + z_loss * lse.square()
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    loss = reduce_loss(rows, valid, reduction)
    if return_argmax:
        return loss, logits.argmax(dim=-1)
    return loss
