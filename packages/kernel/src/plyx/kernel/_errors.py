"""The error a kernel raises on bad input, and the helpers every implementation shares to raise it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plyx.specs.errors import PlyxError

__all__ = ["KernelInputError", "check_float", "check_same_device", "check_last_dim_contiguous", "check_bias",
           "check_no_grad", "shape_str"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class KernelInputError(PlyxError, ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype, device or layout.

    Attributes:
        kernel: the kernel name (``rmsnorm``) and implementation (``rmsnorm:triton``).
        argument: the argument at fault (``weight``).
        problem: what is wrong, with the value seen.
        fix: how to make it right.
    """

    def __init__(self, kernel: str, argument: str, problem: str, fix: str = "") -> None:
        self.kernel = kernel
        self.argument = argument
        self.problem = problem
        self.fix = fix
        message = f"kernel `{kernel}`: argument `{argument}`: {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_float(kernel: str, argument: str, t: Any, *, dtypes: Sequence[str] = _FLOATS) -> None:
    """``t`` must be a tensor of one of ``dtypes``."""
    if not hasattr(t, "dtype") or not hasattr(t, "shape"):
        raise KernelInputError(kernel, argument, f"expected a torch.Tensor, got {type(t).__name__}")
    if _dtype(t) not in dtypes:
        raise KernelInputError(
            kernel, argument, f"dtype {_dtype(t)} is not supported (expected one of {', '.join(dtypes)})",
            f"cast it with `.to(torch.{dtypes[0] if 'bfloat16' not in dtypes else 'bfloat16'})`",
        )


def check_same_device(kernel: str, first: tuple[str, Any], *others: tuple[str, Any | None]) -> None:
    """Every tensor in ``others`` lives on the device of ``first``."""
    name0, t0 = first
    for name, t in others:
        if t is not None and t.device != t0.device:
            raise KernelInputError(
                kernel, name, f"is on {t.device} but `{name0}` is on {t0.device}",
                f"move it with `.to({str(t0.device)!r})`",
            )


def check_last_dim_contiguous(kernel: str, argument: str, t: Any) -> None:
    """Triton kernels read rows with unit stride; a strided last dimension is refused, not silently copied."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelInputError(
            kernel, argument, f"last dimension has stride {t.stride(-1)} (shape {shape_str(t.shape)}), expected 1",
            "call `.contiguous()` on it first",
        )


def check_bias(kernel: str, bias: Any | None, n: int, fix: str = "pass the projection's bias") -> None:
    """``bias`` is None or a float ``[n]`` vector (one per output column)."""
    if bias is None:
        return
    check_float(kernel, "bias", bias)
    if tuple(bias.shape) != (n,):
        raise KernelInputError(kernel, "bias", f"expected [N={n}], got {shape_str(bias.shape)}", fix)


def check_no_grad(kernel: str, tensors: dict[str, Any | None], fix: str) -> None:
    """An inference-only kernel refuses, in grad mode, a tensor that requires grad (it would drop the gradient)."""
    import torch

    if not torch.is_grad_enabled():
        return
    op = kernel.split(":")[0]
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise KernelInputError(kernel, name, f"requires grad, but {op} has no gradient (inference only)", fix)
