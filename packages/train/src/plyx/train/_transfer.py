"""Host-to-device batch transfers that do not stall the step, and a guard that catches host syncs.

``tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) host memory is not asynchronous: CUDA
stages the copy through its own pinned buffer and the host waits for the stream to reach it, i.e. for the
previous step's work to finish. The host then launches the next step's first kernels while the device idles
(a host sync per micro-batch). From page-locked memory the copy is queued like any kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import torch
from plyx.specs import Batch
from plyx.specs.batch import BATCH_SPECS

__all__ = ["no_sync", "to_device"]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device``; to CUDA through page-locked host memory with ``non_blocking`` (no host sync).

    Args:
        batch: a batch from the data stream (host tensors).
        device: the training device.

    Returns:
        The batch's tensors on ``device`` (``meta`` kept).
    """
    if device.type != "cuda":
        return batch.to(device)
    pinned = {name: t.pin_memory() for name in BATCH_SPECS
              if isinstance(t := getattr(batch, name), torch.Tensor) and t.device.type == "cpu" and not t.is_pinned()}
    return attrs.evolve(batch, **pinned).to(device, non_blocking=True)


@contextlib.contextmanager
def no_sync(device: torch.device, *, enabled: bool) -> Iterator[None]:
    """Inside: any CUDA host sync raises (``torch.cuda.set_sync_debug_mode("error")``) when ``enabled`` on CUDA.

    Args:
        device: the training device (other devices: nothing to check).
        enabled: whether to check (``TrainOptions.sync_debug``).
    """
    if not enabled or device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
