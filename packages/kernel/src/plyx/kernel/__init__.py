"""plyx-kernel: the kernel registry and its kernels (PyTorch references everywhere, Triton on CUDA).

Public surface:

- ``registry()``: the process's ``KernelRegistry``; ``registry().get(name, *tensors)``
  returns the implementation chosen for their device, dtype and sizes.
- ``configure(KernelConfig)``, ``reset_registry()``, ``Registry`` (a private registry).
- one dispatching function per kernel name (``rmsnorm``, ``swiglu``, ``rope``, ``rope_qk``,
  ``rope_store_kv``, ``rmsnorm_linear``, ``swiglu_linear``, ``gemv``, ``moe_permute``, ``moe_unpermute``, ``grouped_gemm``, ``cross_entropy``, ``linear_cross_entropy``, ``matmul``, ``paged_attention``; ``attention``
  is the callable subpackage ``plyx.kernel.attention``) and ``rope_tables``.
- ``traceable(name)``: the kernel as a ``torch.library`` custom op (``plyx::<name>``), for code under
  ``torch.compile``.
- ``training_kernels(attention, norms, device=...)``: the training step's attention (torch SDPA / the
  Triton flash kernel) and, under ``torch.compile``, RMSNorm (custom op / Inductor-fused torch ops) choice.
- ``plyx.kernel.reference``: the pure-PyTorch definitions.
"""

from typing import Any

__all__ = [
    "KernelConformanceWarning",
    "KernelFallbackWarning",
    "KernelInputError",
    "Registry",
    "TrainingKernels",
    "attention",
    "configure",
    "cross_entropy",
    "gemv",
    "grouped_gemm",
    "inv_frequencies",
    "linear_cross_entropy",
    "matmul",
    "moe_permute",
    "moe_unpermute",
    "paged_attention",
    "query_for",
    "registry",
    "reset_registry",
    "resolve_training_kernels",
    "rmsnorm",
    "rmsnorm_linear",
    "rope",
    "rope_qk",
    "rope_store_kv",
    "rope_tables",
    "swiglu",
    "swiglu_linear",
    "traceable",
    "training_kernels",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.kernel`` (and so its plugin entry point, ``plyx.kernel._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.kernel._exports``.
    """
    if name in __all__:
        from plyx.kernel import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
