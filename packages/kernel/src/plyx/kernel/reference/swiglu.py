"""``swiglu(gate, up) -> silu(gate) * up``, elementwise, any shape (reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["swiglu", "check_swiglu"]


def check_swiglu(kernel: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float(kernel, "gate", gate)
    check_float(kernel, "up", up)
    check_same_device(kernel, ("gate", gate), ("up", up))
    if gate.shape != up.shape:
        raise KernelInputError(kernel, "up", f"shape {shape_str(up.shape)} differs from gate's {shape_str(gate.shape)}",
                               "split the fused projection into two equal halves")
    if gate.dtype != up.dtype:
        raise KernelInputError(kernel, "up", f"dtype {up.dtype} differs from gate's {gate.dtype}", "cast both to one dtype")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in float32 and returned in the inputs' dtype."""
    check_swiglu("swiglu:reference", gate, up)
    if gate.dtype in (torch.float32, torch.float64):
        return F.silu(gate) * up  # already the compute dtype: no casts (three dispatched no-ops per call)
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
