"""``matmul(a, b) -> a @ b``: a ``[..., M, K]`` times b ``[K, N]`` (reference: torch.matmul, i.e. cuBLAS on CUDA)."""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["matmul", "check_matmul"]


def check_matmul(kernel: str, a: torch.Tensor, b: torch.Tensor) -> None:
    check_float(kernel, "a", a)
    check_float(kernel, "b", b)
    check_same_device(kernel, ("a", a), ("b", b))
    if a.dim() < 2:
        raise KernelInputError(kernel, "a", f"expected [..., M, K], got shape {shape_str(a.shape)}",
                               "add a leading dimension with `a[None]`")
    if b.dim() != 2:
        raise KernelInputError(kernel, "b", f"expected [K, N], got shape {shape_str(b.shape)}",
                               "batch the left operand instead, or call torch.matmul for batched right operands")
    if a.shape[-1] != b.shape[0]:
        raise KernelInputError(kernel, "b", f"first dim {b.shape[0]} differs from a's last dim {a.shape[-1]} "
                               f"(a {shape_str(a.shape)}, b {shape_str(b.shape)})", "pass b as [K, N]")
    if a.dtype != b.dtype:
        raise KernelInputError(kernel, "b", f"dtype {b.dtype} differs from a's {a.dtype}", "cast both to one dtype")


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with a ``[..., M, K]`` and b ``[K, N]``; returns ``[..., M, N]`` in a's dtype."""
    check_matmul("matmul:reference", a, b)
    return torch.matmul(a, b)
