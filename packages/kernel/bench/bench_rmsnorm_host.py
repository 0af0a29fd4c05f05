"""Host-side cost of one eager RMSNorm call up to the Triton launch: microseconds of Python per call.

What runs before the GPU sees a kernel: the registry lookup, argument checks, output allocation, the
autograd Function and the launch's own argument handling. On a GPU this is the gap between eager and
graph time at small sizes (issue 19: 0.104 vs 0.074 ms at the bench shape). Measured here on CPU with
Triton's interpreter off and the launch itself replaced by a no-op (``--launch stub``, the default), so
only plyx's Python path is timed; ``--launch cuda`` times the real eager call on a GPU (synchronised).

    python packages/kernel/bench/bench_rmsnorm_host.py [--calls 20000] [--launch stub|cuda] [--out DIR]

Paths: ``kernel`` calls ``plyx.kernel.triton_ops.rmsnorm.rmsnorm`` directly; ``module`` is
``plyx.attn.RMSNorm``'s forward path (``registry().get`` then the call), the registry forced to the
Triton implementation; each without and with a residual, grad off and on (on: the autograd graph is built).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` returns at once."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **meta: None


def _us_per_call(fn: Any, calls: int, sync: Any) -> float:
    for _ in range(min(calls, 2000)):  # warm-up: caches filled, the kernel compiled on a GPU
        fn()
    sync()
    runs = []
    for _ in range(7):  # median of seven: the machine may be shared
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--launch", choices=("stub", "cuda"), default="stub")
    parser.add_argument("--hidden", type=int, default=64, help="row width (tiny: host cost dominates)")
    parser.add_argument("--out", type=Path, help="append JSON lines to OUT/rmsnorm-host-<device>-<date>.jsonl")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter's launch is not what a GPU pays")
    from plyx.kernel import registry
    from plyx.kernel.triton_ops import rmsnorm as op
    from plyx.kernel.triton_ops._registration import _lazy
    from plyx.specs.kernels import Capability, KernelImpl

    if args.launch == "cuda":
        if not torch.cuda.is_available():
            parser.error("--launch cuda needs a GPU")
        device, sync = torch.device("cuda"), torch.cuda.synchronize
        where = torch.cuda.get_device_name()
    else:
        op._rmsnorm_fwd = _NoLaunch()  # type: ignore[assignment]
        device, sync = torch.device("cpu"), (lambda: None)
        where = f"cpu ({platform.processor() or platform.machine()}), launch stubbed"
    reg = registry()
    if device.type == "cpu":  # the Triton implementation accepts CPU tensors here (its launch is a no-op)
        reg.register(KernelImpl("rmsnorm", "triton-host", _lazy("rmsnorm", "rmsnorm"), capability=Capability(),
                                priority=1000))
    d = args.hidden
    x, r = torch.randn(4, d, device=device), torch.randn(4, d, device=device)
    w = torch.ones(d, device=device)
    date = datetime.date.today().isoformat()
    print(f"{where}, Python {platform.python_version()}, torch {torch.__version__}, {date}: [4, {d}]")
    rows = []
    for grad in (False, True):
        xg, rg, wg = (t.clone().requires_grad_(grad) for t in (x, r, w))
        for residual in (False, True):
            kw: dict[str, Any] = {"eps": 1e-6}
            if residual:
                kw["residual"] = rg
            paths = {
                "kernel": lambda kw=kw, xg=xg, wg=wg: op.rmsnorm(xg, wg, **kw),
                "module": lambda kw=kw, xg=xg, wg=wg: reg.get("rmsnorm", xg, wg)(xg, wg, **kw),
            }
            for path, fn in paths.items():
                with torch.enable_grad() if grad else torch.no_grad():
                    us = _us_per_call(fn, args.calls, sync)
                row = {"path": path, "residual": residual, "grad": grad, "us_per_call": round(us, 2),
                       "device": where, "date": date, "torch": torch.__version__, "hidden": d}
                rows.append(row)
                print(f"{path:>7}  residual={residual!s:<5}  grad={grad!s:<5}  {us:7.2f} us/call")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = "cpu" if device.type == "cpu" else where.replace(" ", "-").lower()
        with (args.out / f"rmsnorm-host-{slug}-{date}.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
