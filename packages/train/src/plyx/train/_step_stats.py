"""A step's loss and gradient norm, read back to the host without stalling the device.

``float(loss)`` inside the step is a CPU-GPU sync point: the host waits for the GPU to finish the step
before it may queue the next one, and the GPU idles while the host launches it. Here each step's two
scalars are copied into pinned host memory with ``non_blocking=True`` behind a CUDA event and read one
step later, when the host has already queued the next step's work: the GPU always has a step queued.

The non-finite guard stays on the device: ``skip_update`` hands the optimizer a ``found_inf`` flag
(the protocol ``torch.amp.GradScaler`` uses with torch's fused and foreach optimizers), so a step whose
loss or gradient norm is NaN/inf does not update the weights even though the host learns of it a step
later; the Trainer then raises ``NonFiniteLossError`` for that step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

__all__ = ["PendingStep", "StepStats", "can_skip_update", "skip_update"]


@attrs.define(kw_only=True)
class PendingStep:
    """One step's scalars on their way to the host, with what the Trainer logs beside them."""

    step: int
    values: torch.Tensor  # [2] float32: loss, grad_norm (pinned host memory, or the device tensor)
    event: Any  # torch.cuda.Event, or None when the values are already on the host
    extra: dict[str, Any]

    def read(self) -> tuple[float, float]:
        """``(loss, grad_norm)``; waits for the copy only if it has not landed yet."""
        if self.event is not None:
            self.event.synchronize()
        loss, grad_norm = self.values.tolist()
        return float(loss), float(grad_norm)


class StepStats:
    """A queue of ``PendingStep``: ``push`` after the step's kernels are queued, ``ready`` to read them back.

    Args:
        device: the training device; on CUDA the values travel through pinned memory behind an event.
        lookahead: steps kept in flight before ``ready`` returns them (1: read step N while N+1 runs; 0: at once).
    """

    def __init__(self, device: torch.device, *, lookahead: int = 1) -> None:
        self.asynchronous = device.type == "cuda"
        self.lookahead = lookahead
        self._queue: list[PendingStep] = []

    def push(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, **extra: Any) -> None:
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())])  # [2]
        event = None
        if self.asynchronous:
            host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._queue.append(PendingStep(step=step, values=values, event=event, extra=extra))

    def ready(self, *, flush: bool = False) -> Iterator[PendingStep]:
        """The pending steps that are due: all but the newest ``lookahead`` (every one with ``flush``)."""
        keep = 0 if flush else self.lookahead
        while len(self._queue) > keep:
            yield self._queue.pop(0)

    def __len__(self) -> int:
        return len(self._queue)


def can_skip_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` on the device: torch's fused optimizers do."""
    return bool(optimizer.param_groups) and all(group.get("fused") for group in optimizer.param_groups)


def skip_update(optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Make the next ``optimizer.step()`` a no-op on the device when ``loss`` or ``grad_norm`` is not finite.

    Sets ``optimizer.found_inf`` (and ``grad_scale = None``), which torch's fused Adam/AdamW/SGD read in
    ``step``, as ``GradScaler`` does. Returns False (nothing set) for optimizers without a fused kernel:
    the caller must then check on the host before stepping.
    """
    if not can_skip_update(optimizer):
        return False
    bad = ~(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach()))
    optimizer.found_inf = bad.float().reshape(())  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    return True
