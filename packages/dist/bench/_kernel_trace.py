"""Run ``plyx train`` in this process and record which kernel implementation served each kernel name.

``python _kernel_trace.py OUT.json train CONFIG [plyx train options]``: the arguments after OUT are
``plyx``'s. Every ``registry().get`` call of the run (plyx-model's rmsnorm, swiglu, rope,
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
    from plyx.specs.cli import main as plyx

    return int(plyx(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
