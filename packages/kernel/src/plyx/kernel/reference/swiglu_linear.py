"""``swiglu_linear(gate_up, weight, *, bias=None)`` (reference): a packed MLP's down projection of its SwiGLU.

The decode-step fusion of "SwiGLU of the packed gate/up output" with the down projection::

    gate, up = gate_up[..., :F], gate_up[..., F:]   # the stacked [gate; up] GEMV's output, [..., 2F]
    a = silu(gate) * up                             # plyx.kernel.reference.swiglu, rounded to the input dtype
    return a @ weight.T (+ bias)                    # weight [N, F]

Inference only (no gradient): training keeps ``swiglu`` and a linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_bias, check_float, check_no_grad, check_same_device, shape_str
from plyx.kernel.reference.swiglu import swiglu

__all__ = ["swiglu_linear", "check_swiglu_linear"]


def check_swiglu_linear(kernel: str, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Validate shapes, dtypes and devices (reads no tensor values: capturable)."""
    check_float(kernel, "gate_up", gate_up)
    check_float(kernel, "weight", weight)
    check_same_device(kernel, ("gate_up", gate_up), ("weight", weight), ("bias", bias))
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise KernelInputError(kernel, "gate_up", f"expected [..., 2F] (gate then up), got {shape_str(gate_up.shape)}",
                               "pass the packed gate/up projection's output")
    f = gate_up.shape[-1] // 2
    if weight.dim() != 2 or weight.shape[1] != f:
        raise KernelInputError(kernel, "weight", f"expected [N, F={f}] (half of gate_up's last dim), got "
                               f"{shape_str(weight.shape)}", "pass the down projection's weight")
    check_bias(kernel, bias, weight.shape[0], "pass the down projection's bias")
    check_no_grad(kernel, {"gate_up": gate_up, "weight": weight, "bias": bias},
                  "call it under torch.inference_mode() / torch.no_grad(), or use `swiglu` and a linear")

def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_swiglu_linear("swiglu_linear:reference", gate_up, weight, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    a = swiglu(gate, up)
    return F.linear(a, weight.to(a.dtype), None if bias is None else bias.to(a.dtype))
