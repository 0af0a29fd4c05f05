"""Force the pure-torch reference kernels while a model is traced for export.

The model resolves ``rmsnorm``, ``swiglu``, ``rope`` and ``attention`` from the
kernel registry at every call; the registry would pick Triton kernels on CUDA
or ``sdpa`` on CPU, which the ONNX exporter either cannot trace or translates
into different ops. The references are plain torch, so every op in the graph
has an ONNX translation and the graph computes the reference math.

plyx-export does not depend on plyx-kernel (workspace.toml), so it uses the
registry's documented process-wide override, the ``PLYX_KERNELS`` environment
variable (``name=impl,...``), rather than ``registry().override()``. A scoped
``registry().override(...)`` around the export still wins over it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from plyx.specs.config import KernelConfig
from plyx.specs.kernels import KERNEL_NAMES

__all__ = ["REFERENCE_IMPL", "reference_kernels"]

#: the implementation name every kernel's pure-torch reference is registered under
REFERENCE_IMPL = "reference"
_ENV = "PLYX_KERNELS"
_LOCK = threading.RLock()  # the environment is process-wide: one export at a time sets it


@contextlib.contextmanager
def reference_kernels() -> Iterator[dict[str, str]]:
    """Inside the block every contract kernel name (``plyx.specs.kernels.KERNEL_NAMES``) selects ``reference``.

    Other entries of ``PLYX_KERNELS`` are kept; the variable is restored on exit.

    Example::

        with reference_kernels():
            logits = model(ids)          # rmsnorm:reference, attention:reference, ...
    """
    forced = dict.fromkeys(KERNEL_NAMES, REFERENCE_IMPL)
    with _LOCK:
        before = os.environ.get(_ENV)
        merged = {**(KernelConfig.parse_env(before) if before else {}), **forced}
        os.environ[_ENV] = ",".join(f"{name}={impl}" for name, impl in merged.items())
        try:
            yield forced
        finally:
            if before is None:
                os.environ.pop(_ENV, None)
            else:
                os.environ[_ENV] = before
