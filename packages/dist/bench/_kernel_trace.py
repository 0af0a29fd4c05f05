"""Run ``plyx train`` in this process and record which kernel implementation served each kernel name.

``python _kernel_trace.py OUT.json [--async-stats] [--clock CLOCK.json START STOP] [--profile PROFILE.json START STEPS]
train CONFIG [...]``:
the arguments after OUT (and this script's own options) are ``plyx``'s. ``--profile`` runs ``torch.profiler``
over the ``STEPS`` steps reported after step ``START`` and ``--clock`` stamps wall and CPU times from step
``START`` to ``STOP``, the device synchronised at both (``_step_profile.py``); ``--async-stats`` gives the
Trainer ``TrainOptions(async_stats=True)`` (the CUDA step, loss and gradient norm read a step late and
the norm clipped on the device, which a CPU run otherwise replaces with its synchronising step), so a CPU
run takes the code path a GPU run takes. Every ``registry().get`` call of the run (plyx-model's rmsnorm, swiglu, rope,
attention, linear_cross_entropy...) is recorded with the implementation it returned, the dtype and
device of its first tensor and the Python types of its tensors, so the benchmark can show whether
the Triton kernels served both paths and whether DTensors reached them (a DTensor argument would
mean a sharded parameter got to a kernel). Only the first 256 distinct calls are kept; the cost
per call is one tuple and one set lookup (~1 us, identical in both paths).

The FSDP path is run at world size 1 by setting torchrun's variables in the environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...): the same Trainer and strategy as
``plyx train CONFIG --nproc 1``, without the launcher's extra process.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def trace(out: Path) -> None:
    """Wrap the default registry's ``get``; write what it served to ``out`` at exit (rank 0 only)."""
    from plyx.kernel import registry

    reg = registry()
    get: Callable[..., Any] = reg.get
    seen: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def traced(name: str, *tensors: Any, **shape: int) -> Callable[..., Any]:
        fn = get(name, *tensors, **shape)
        if len(seen) < 256:
            first = tensors[0] if tensors else None
            key = (name, str(getattr(first, "dtype", "")).removeprefix("torch."),
                   getattr(getattr(first, "device", None), "type", ""),
                   tuple(sorted({type(t).__name__ for t in tensors})))
            seen.setdefault(key, fn)
        return fn

    reg.get = traced  # type: ignore[method-assign]  # the instance attribute shadows the method

    def write() -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        rows = []
        for (name, dtype, device, types), fn in sorted(seen.items(), key=lambda kv: kv[0]):
            impl = next((i.impl for i in reg.implementations(name) if i.fn is fn), getattr(fn, "__qualname__", "?"))
            rows.append({"kernel": name, "impl": impl, "dtype": dtype, "device": device, "tensor_types": list(types)})
        out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")

    atexit.register(write)


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    trace(out)
    if argv[:1] == ["--async-stats"]:
        import attrs
        from plyx.train import _trainer

        init = _trainer.Trainer.__init__

        def with_async_stats(self: Any, config: Any, **kw: Any) -> None:
            kw["options"] = attrs.evolve(kw.get("options") or _trainer.TrainOptions(), async_stats=True)
            init(self, config, **kw)

        _trainer.Trainer.__init__ = with_async_stats  # type: ignore[method-assign]
        argv = argv[1:]
    if argv[:1] == ["--clock"]:
        import _step_profile

        _step_profile.install_clock(Path(argv[1]), int(argv[2]), int(argv[3]))
        argv = argv[4:]
    if argv[:1] == ["--profile"]:
        import _step_profile

        _step_profile.install(Path(argv[1]), int(argv[2]), int(argv[3]))
        argv = argv[4:]
    from plyx.specs.cli import main as plyx

    return int(plyx(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
