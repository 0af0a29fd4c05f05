"""Dispatch cost: microseconds per ``registry().get(name, *tensors)`` call, before and after the fast cache.

"before" is what ``get`` did until the fast cache existed and what it still
does on a miss: build the ``KernelQuery`` (``query_for``) and ``select``
through the shape-class cache. "after" is ``get`` itself. Both run on the
default registry (every installed plugin), CPU tensors, grad off, for a few
kernel names of a decode step: names with a shape-dependent implementation
(rmsnorm, attention, paged_attention: keyed by exact sizes) and without
(swiglu), also inside a ``registry().override(...)`` block.

    python packages/kernel/bench/bench_dispatch.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time

import torch
from plyx.kernel import query_for, registry


def _cases() -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
    x = torch.randn(32, 1, 4096)
    q = torch.randn(32, 1, 32, 128)
    pool = torch.randn(64, 16, 8, 128)
    return {
        "rmsnorm": ("rmsnorm", (x, torch.ones(4096))),
        "swiglu": ("swiglu", (x, x)),
        "attention": ("attention", (q, torch.randn(32, 8, 8, 128), torch.randn(32, 8, 8, 128))),
        "paged_attention": ("paged_attention", (q, pool, pool, torch.zeros(32, 4, dtype=torch.int32),
                                                torch.ones(32, dtype=torch.int32))),
    }


def _us_per_call(fn, calls: int) -> float:
    for _ in range(min(calls, 1000)):  # warm-up: fills the caches
        fn()
    best = float("inf")
    for _ in range(5):  # best of five: the machine may be shared
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    reg = registry()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
    print(f"{'case':<28} {'before us':>10} {'after us':>10} {'speed-up':>9}")
    with torch.no_grad():
        for label, (name, tensors) in _cases().items():
            for scope in ("", "override"):
                ctx = reg.override(**{name: "reference"}) if scope else contextlib.nullcontext()
                with ctx:
                    assert reg.get(name, *tensors) is reg.select(name, query_for(name, *tensors)).fn
                    before = _us_per_call(lambda n=name, t=tensors: reg.select(n, query_for(n, *t)).fn, args.calls)
                    after = _us_per_call(lambda n=name, t=tensors: reg.get(n, *t), args.calls)
                case = label + (" (override)" if scope else "")
                print(f"{case:<28} {before:>10.2f} {after:>10.2f} {before / after:>8.1f}x")


if __name__ == "__main__":
    main()
