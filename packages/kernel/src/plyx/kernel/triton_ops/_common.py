"""Helpers every Triton op shares: output allocation (poisonable for tests), launch sizes, interpreter detection."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["empty", "poisoned", "interpreting", "num_programs", "next_power_of_2", "pdl"]

_POISON: list[bool] = [False]


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Inside the block, outputs are allocated filled with NaN (floats) or -7 (ints): an element a kernel
    forgets to write shows up in the comparison instead of hiding behind the allocator's zeros."""
    _POISON.append(True)
    try:
        yield
    finally:
        _POISON.pop()


def empty(shape: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _POISON[-1]:
        out.fill_(float("nan") if dtype.is_floating_point else -7)
    return out


def interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``): tests run the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: programmatic dependent launch for the kernels that support it (``pdl``); ``PLYX_TRITON_PDL=0`` turns it off
PDL_ENABLED = os.environ.get("PLYX_TRITON_PDL", "1") not in ("", "0")
_PDL: dict[int, bool] = {}


def pdl(device: torch.device) -> bool:
    """Launch with programmatic dependent launch on ``device``: Hopper or newer, compiled (not the interpreter).

    A kernel launched so may start while the kernel before it in the stream finishes: it streams the
    data the previous kernel does not write (weights) first, then waits (``gdc_wait``) before reading
    anything the previous kernel produced. That hides one kernel's ramp behind the other's tail.
    """
    if not PDL_ENABLED or device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL:
        _PDL[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _PDL[index]


_SMS: dict[int, int] = {}


def num_programs(device: torch.device, rows: int, per_sm: int = 4) -> int:
    """Programs for a persistent row loop: a few per SM on CUDA, a handful in the interpreter."""
    if device.type != "cuda":
        return max(1, min(rows, 3))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(rows, _SMS[index] * per_sm))


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
