"""Helpers every Triton op shares: output allocation (poisonable for tests), launch sizes, interpreter detection."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["empty", "poisoned", "interpreting", "launch", "num_programs", "next_power_of_2", "pdl"]

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


def _direct_launch_supported() -> bool:
    """Triton >= 3.4 (``triton.knobs``; its JIT passes every bound argument, constexprs included, to the
    compiled kernel's launcher), compiled (not the interpreter); ``PLYX_TRITON_DIRECT_LAUNCH=0`` turns it off."""
    if os.environ.get("PLYX_TRITON_DIRECT_LAUNCH", "1") in ("", "0") or interpreting():
        return False
    try:
        import triton
        from triton import knobs  # noqa: F401
    except ImportError:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 4)


#: launch a cached compiled kernel directly (``launch``); decided once, at import
DIRECT_LAUNCH = _direct_launch_supported()


def launch(cache: dict[Any, Any], key: Any, kernel: Any, grid: tuple[int, int, int], args: tuple[Any, ...],
           **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, the compiled kernel remembered under ``key`` so later calls skip the JIT.

    ``JITFunction.run`` binds and specialises every argument (pointer alignment, integers divisible by 16
    or equal to 1), hashes the key and looks the kernel up on each call: tens of microseconds of Python
    on a launch-bound eager call (issue 19: RMSNorm's 0.104 ms eager vs 0.074 ms graph time). A cached
    handle is launched as ``CompiledKernel.__getitem__``'s runner does. The caller's ``key`` must
    determine that specialisation (dtypes, constexprs, options, and the integer arguments' and pointers'
    16-divisibility: callers take this path only for 16-byte aligned tensors with strides fixed by the
    key), or be None for the plain JIT launch. ``args`` holds every kernel parameter positionally, the
    constexprs too; ``meta`` the launch options (num_warps, launch_pdl).

    Args:
        cache: the caller's dict of compiled kernels (one per kernel).
        key: hashable specialisation key, or None.
        kernel: the ``@triton.jit`` function.
        grid: three grid sizes.
        args: all parameters, in the kernel's order.
        meta: launch options, applied at the first (JIT) launch of a key.
    """
    if key is None or not DIRECT_LAUNCH:
        kernel[grid](*args, **meta)
        return
    # the driver is asked for the device only once a compiled kernel is cached: the interpreter (even when
    # TRITON_INTERPRET was set after this module's import) and CPU-only processes never reach it
    compiled = cache.get((device := _current_device(), key)) if cache else None
    if compiled is None:
        compiled = kernel[grid](*args, **meta)
        if getattr(compiled, "packed_metadata", None) is not None:  # the interpreter returns no compiled kernel
            cache[(_current_device(), key)] = compiled  # the JIT's compiled kernels are per current device too
        return
    stream = _current_stream(device)
    runtime = _triton()[1].runtime
    enter = runtime.launch_enter_hook
    # the launch metadata is built for the enter hook alone (profilers): none registered, none built
    # (Triton >= 3.5 keeps an empty hook chain rather than None, and calls it with whatever it gets)
    metadata = None if enter is None or not getattr(enter, "calls", True) else compiled.launch_metadata(
        grid, stream, *args)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 runtime.launch_exit_hook, *args)


_TRITON: list[Any] = []


def _triton() -> tuple[Any, Any]:
    """``(triton.runtime.driver.driver, triton.knobs)``, imported once."""
    if not _TRITON:
        from triton import knobs
        from triton.runtime.driver import driver

        _TRITON.extend((driver, knobs))
    return _TRITON[0], _TRITON[1]


def _current_device() -> int:
    return _triton()[0].active.get_current_device()


def _current_stream(device: int) -> Any:
    return _triton()[0].active.get_current_stream(device)
