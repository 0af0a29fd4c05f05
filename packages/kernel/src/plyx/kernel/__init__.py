"""plyx-kernel: the kernel registry and its kernels (PyTorch references everywhere, Triton on CUDA).

Public surface:

- ``registry()``: the process's ``KernelRegistry``; ``registry().get(name, *tensors)``
  returns the implementation chosen for their device, dtype and sizes.
- ``configure(KernelConfig)``, ``reset_registry()``, ``Registry`` (a private registry).
- one dispatching function per kernel name (``rmsnorm``, ``swiglu``, ``rope``,
  ``rope_store_kv``, ``rmsnorm_linear``, ``swiglu_linear``, ``gemv``, ``cross_entropy``, ``linear_cross_entropy``, ``matmul``, ``paged_attention``; ``attention``
  is the callable subpackage ``plyx.kernel.attention``) and ``rope_tables``.
- ``traceable(name)``: the kernel as a ``torch.library`` custom op (``plyx::<name>``), for code under
  ``torch.compile``.
- ``plyx.kernel.reference``: the pure-PyTorch definitions.
"""

from plyx.kernel import attention  # the subpackage; calling it dispatches the `attention` kernel
from plyx.kernel._custom_ops import traceable
from plyx.kernel._default import configure, registry, reset_registry
from plyx.kernel._dispatch import (
    cross_entropy,
    gemv,
    linear_cross_entropy,
    matmul,
    paged_attention,
    rmsnorm,
    rmsnorm_linear,
    rope,
    rope_store_kv,
    swiglu,
    swiglu_linear,
)
from plyx.kernel._errors import KernelInputError
from plyx.kernel._registry import KernelConformanceWarning, KernelFallbackWarning, Registry, query_for
from plyx.kernel._rope_tables import inv_frequencies, rope_tables

__all__ = [
    "KernelConformanceWarning",
    "KernelFallbackWarning",
    "KernelInputError",
    "Registry",
    "attention",
    "configure",
    "cross_entropy",
    "gemv",
    "inv_frequencies",
    "linear_cross_entropy",
    "matmul",
    "paged_attention",
    "query_for",
    "registry",
    "reset_registry",
    "rmsnorm",
    "rmsnorm_linear",
    "rope",
    "rope_store_kv",
    "rope_tables",
    "swiglu",
    "swiglu_linear",
    "traceable",
]
