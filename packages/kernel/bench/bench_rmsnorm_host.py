"""Host-side cost of one eager RMSNorm call, up to and including the Triton launch: microseconds of Python per call.

What runs before the GPU sees a kernel: the registry lookup, argument checks, output allocation, the
autograd Function and the launch's own argument handling. On a GPU this is the gap between eager and
graph time at small sizes (issue 19: 0.104 vs 0.074 ms at the bench shape).

``--launch fake`` (the default) runs on CPU: a stand-in for Triton's CUDA driver (device 0, stream 0, an
sm_90 target) lets ``JITFunction.run`` do its whole per-call work (binding and specialising every
argument, the cache key, the lookup), and the kernels it would compile are replaced by a no-op compiled
kernel. So both launch paths are timed as a GPU host pays them, minus the driver's own launch call:
``launch=jit`` (``_common.DIRECT_LAUNCH`` off: the JIT on every call, the path before 1.7.0) and
``launch=direct`` (the cached compiled kernel launched directly). ``--launch cuda`` times the real eager
call on a GPU (synchronised), both paths.

    python packages/kernel/bench/bench_rmsnorm_host.py [--calls 20000] [--launch fake|cuda] [--out DIR]

Paths: ``kernel`` calls ``plyx.kernel.triton_ops.rmsnorm.rmsnorm`` directly; ``module`` is
``plyx.attn.RMSNorm``'s forward path (``registry().get`` then the call), the registry forced to the
Triton implementation; each without and with a residual, grad off and on (on: the autograd graph is
built), and ``fwd+bwd`` (the call, then ``torch.autograd.backward`` with a fixed output gradient: the
backward's two launches).
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


class _NoOpCompiled:
    """Stands in for a compiled kernel: its launch returns at once."""

    packed_metadata: tuple = ()
    function = None

    def launch_metadata(self, grid: Any, stream: Any, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


class _FakeCudaDriver:
    """Just enough of Triton's CUDA driver for ``JITFunction.run`` on a machine without a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_device_capability(self, device: int = 0) -> tuple[int, int]:
        return (9, 0)


def _fake_gpu(kernels: list[Any]) -> None:
    """Install the stand-in driver; each kernel's compile stores and returns the no-op compiled kernel."""
    from triton.runtime.driver import driver

    driver.set_active(_FakeCudaDriver())
    noop = _NoOpCompiled()
    for kernel in kernels:
        def compile_noop(key: Any, signature: Any, device: int, constexprs: Any, options: Any, attrs: Any,
                         warmup: bool, kernel: Any = kernel) -> _NoOpCompiled:
            kernel.device_caches[device][0][key] = noop  # the JIT's own cache: later calls find it
            return noop
        kernel._do_compile = compile_noop


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
    parser.add_argument("--launch", choices=("fake", "cuda"), default="fake")
    parser.add_argument("--hidden", type=int, default=64, help="row width (tiny: host cost dominates)")
    parser.add_argument("--out", type=Path, help="append JSON lines to OUT/rmsnorm-host-<device>-<date>.jsonl")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter's launch is not what a GPU pays")
    from plyx.kernel import registry
    from plyx.kernel.triton_ops import _common
    from plyx.kernel.triton_ops import rmsnorm as op
    from plyx.kernel.triton_ops._registration import _lazy
    from plyx.specs.kernels import Capability, KernelImpl

    if args.launch == "cuda":
        if not torch.cuda.is_available():
            parser.error("--launch cuda needs a GPU")
        device, sync = torch.device("cuda"), torch.cuda.synchronize
        where = torch.cuda.get_device_name()
    else:
        # (getattr: the same script times an older rmsnorm module, without _dw_reduce, for before/after)
        _fake_gpu([k for k in (getattr(op, n, None) for n in ("_rmsnorm_fwd", "_rmsnorm_bwd", "_dw_reduce")) if k])
        device, sync = torch.device("cpu"), (lambda: None)
        where = f"cpu ({platform.processor() or platform.machine()}), fake CUDA driver, no-op kernels"
    reg = registry()
    if device.type == "cpu":  # the Triton implementation accepts CPU tensors here (its launches are no-ops)
        reg.register(KernelImpl("rmsnorm", "triton-host", _lazy("rmsnorm", "rmsnorm"), capability=Capability(),
                                priority=1000))
    d = args.hidden
    x, r = torch.randn(4, d, device=device), torch.randn(4, d, device=device)
    w = torch.ones(d, device=device)
    dy = torch.randn(4, d, device=device)
    date = datetime.date.today().isoformat()
    direct_default = getattr(_common, "DIRECT_LAUNCH", False)
    print(f"{where}, Python {platform.python_version()}, torch {torch.__version__}, {date}: [4, {d}]")
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        for grad in ((False, True) if mode == "fwd" else (True,)):
            xg, rg, wg = (t.clone().requires_grad_(grad) for t in (x, r, w))
            for residual in (False, True):
                kw: dict[str, Any] = {"eps": 1e-6}
                if residual:
                    kw["residual"] = rg

                def first(out: Any) -> torch.Tensor:
                    return out[0] if isinstance(out, tuple) else out

                paths = {
                    "kernel": lambda kw=kw, xg=xg, wg=wg: op.rmsnorm(xg, wg, **kw),
                    "module": lambda kw=kw, xg=xg, wg=wg: reg.get("rmsnorm", xg, wg)(xg, wg, **kw),
                }
                if mode == "fwd+bwd":
                    paths = {name: (lambda fn=fn: torch.autograd.backward(first(fn()), dy)) for name, fn in paths.items()}
                for path, fn in paths.items():
                    for direct in ((False, True) if direct_default else (False,)):
                        _common.DIRECT_LAUNCH = direct
                        with torch.enable_grad() if grad else torch.no_grad():
                            us = _us_per_call(fn, args.calls, sync)
                        launch = "direct" if direct else "jit"
                        row = {"path": path, "mode": mode, "residual": residual, "grad": grad, "launch": launch,
                               "us_per_call": round(us, 2), "device": where, "date": date, "torch": torch.__version__,
                               "hidden": d}
                        rows.append(row)
                        print(f"{path:>7}  {mode:<8} residual={residual!s:<5}  grad={grad!s:<5}  launch={launch:<6}  "
                              f"{us:7.2f} us/call")
    _common.DIRECT_LAUNCH = direct_default
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = "cpu" if device.type == "cpu" else where.replace(" ", "-").lower()
        with (args.out / f"rmsnorm-host-{slug}-{date}.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
