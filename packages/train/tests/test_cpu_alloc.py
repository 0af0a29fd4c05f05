"""The CPU allocator setting of ``Trainer.fit`` (``plyx.train._cpu_alloc``): large blocks reused from the heap,
the user's own allocator choice left alone. Each case runs in a fresh interpreter (the setting is process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt only")

# the most mmapped blocks (mallinfo2's hblks) added during 20 malloc/free rounds of 8 MiB, and what tune_cpu_allocator said
_PROBE = """
import ctypes, sys
from plyx.train._cpu_alloc import tune_cpu_allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
tuned = tune_cpu_allocator() if sys.argv[1] == "tune" else None
base, mapped = libc.mallinfo2().hblks, 0
for _ in range(20):
    p = libc.malloc(8 << 20)
    mapped = max(mapped, libc.mallinfo2().hblks - base)
    libc.free(p)
print(tuned, mapped)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k in ("LD_PRELOAD", "PLYX_CPU_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_tuned_allocator_serves_large_blocks_from_the_heap():
    """Untuned, an 8 MiB block is an mmap (glibc's threshold starts at 128 KiB); tuned, it comes from the heap."""
    assert _probe("none") == ("None", 1)
    assert _probe("tune") == ("True", 0)


@glibc_only
@pytest.mark.parametrize("env", [{"PLYX_CPU_MALLOC": "0"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"MALLOC_ARENA_MAX_": "2"}])
def test_the_users_choice_is_left_alone(env):
    assert _probe("tune", **env) == ("False", 1)  # glibc's own threshold (128 KiB at first) still in force


def test_fit_on_cpu_applies_the_setting(tiny_config, prepared, tmp_path, monkeypatch):
    """``Trainer.fit`` on CPU asks for the setting before its first step (the GPU path never does)."""
    import plyx.train._trainer as trainer_module
    from plyx.train import Trainer, TrainOptions

    calls = []
    monkeypatch.setattr(trainer_module, "tune_cpu_allocator", lambda: calls.append(True) or True)
    cfg = tiny_config(prepared, tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0, sample_tokens=0,
                      device="cpu")
    Trainer(cfg, options=TrainOptions(progress=False)).fit()
    assert calls == [True]
