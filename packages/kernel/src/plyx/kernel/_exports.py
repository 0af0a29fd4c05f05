"""The public names of ``plyx.kernel``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.kernel.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.kernel import attention  # the subpackage; calling it dispatches the `attention` kernel
from plyx.kernel._custom_ops import traceable
from plyx.kernel._default import configure, registry, reset_registry
from plyx.kernel._dispatch import (
    cross_entropy,
    gemv,
    grouped_gemm,
    linear_cross_entropy,
    matmul,
    moe_permute,
    moe_unpermute,
    paged_attention,
    rmsnorm,
    rmsnorm_linear,
    rope,
    rope_qk,
    rope_store_kv,
    swiglu,
    swiglu_linear,
)
from plyx.kernel._errors import KernelInputError
from plyx.kernel._registry import KernelConformanceWarning, KernelFallbackWarning, Registry, query_for
from plyx.kernel._rope_tables import inv_frequencies, rope_tables
from plyx.kernel._training import TrainingKernels, resolve_training_kernels, training_kernels
