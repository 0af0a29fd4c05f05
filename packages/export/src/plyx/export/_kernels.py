"""Force the pure-torch reference kernels while a model is traced for export.

The model resolves ``rmsnorm``, ``swiglu``, ``rope`` and ``attention`` from the
kernel registry at every call; the registry would pick Triton kernels on CUDA
or ``sdpa`` on CPU, which the ONNX exporter either cannot trace or translates
into different ops. The references are plain torch, so every op in the graph
has an ONNX translation and the graph computes the reference math.

The override is the registry's scoped one (a context variable): it holds for
this thread or task only, so a server selecting kernels in another thread
during an export keeps its fast kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import plyx.kernel
from plyx.specs.kernels import KERNEL_NAMES

__all__ = ["REFERENCE_IMPL", "reference_kernels"]

#: the implementation name every kernel's pure-torch reference is registered under
REFERENCE_IMPL = "reference"


@contextlib.contextmanager
def reference_kernels() -> Iterator[dict[str, str]]:
    """Inside the block every contract kernel name (``plyx.specs.kernels.KERNEL_NAMES``) selects ``reference``.

    Example::

        with reference_kernels():
            logits = model(ids)          # rmsnorm:reference, attention:reference, ...
    """
    forced = dict.fromkeys(KERNEL_NAMES, REFERENCE_IMPL)
    with plyx.kernel.registry().override(**forced):
        yield forced
