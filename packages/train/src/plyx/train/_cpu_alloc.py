"""CPU training: keep glibc's allocator from handing every activation back to the kernel.

glibc ``malloc`` serves a request above its mmap threshold (128 KiB, raised dynamically up to 32 MiB as large
blocks are freed) with a fresh ``mmap`` and returns it with ``munmap`` on free; memory it frees at the top of the
heap beyond the trim threshold goes back to the kernel too. A CPU training step allocates and frees the same
activation and gradient sizes every iteration (nanoGPT's CPU recipe: about a hundred 0.4-1 MiB tensors), so each
one is page-faulted and zero-filled by the kernel again, step after step. Raising both thresholds once keeps those
blocks in the heap for reuse (what tcmalloc/jemalloc, which PyTorch's CPU performance guide recommends preloading,
do by design): 2-3 % of the recipe's step, more for plyx's than for nanoGPT's (issue 20; bench/results/README.md).

Applied by ``Trainer.fit`` on CPU only (a GPU run's host allocations are few and large, and CUDA memory is torch's
caching allocator's); not where the user chose an allocator (``MALLOC_*`` tunables in the environment or a
preloaded allocator), with ``PLYX_CPU_MALLOC=0``, or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_cpu_allocator"]

#: blocks below this come from the heap and are reused (glibc's dynamic maximum is 32 MiB on 64-bit)
MMAP_THRESHOLD = 256 << 20
#: free memory kept at the heap's top before it is returned to the kernel: bounds what the process retains
TRIM_THRESHOLD = 1 << 30

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Set glibc's mmap and trim thresholds for a CPU training loop, once per process.

    Returns:
        True if the thresholds are (now) set by plyx; False where it left the allocator alone (not glibc, the
        user's own ``MALLOC_*``/``LD_PRELOAD`` choice, ``PLYX_CPU_MALLOC=0``, or ``mallopt`` refused).
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("PLYX_CPU_MALLOC", "1") == "0" or platform.system() != "Linux":
        return False
    if platform.libc_ver()[0] != "glibc" or os.environ.get("LD_PRELOAD"):
        return False  # musl, or tcmalloc/jemalloc preloaded: they reuse blocks already
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False  # the user tuned glibc through its environment variables
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first: setting it also stops glibc's dynamic adjustment
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned
