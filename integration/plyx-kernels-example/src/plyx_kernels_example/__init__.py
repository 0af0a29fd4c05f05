"""plyx-kernels-example: a third-party plugin that adds an implementation of an existing kernel name.

It is found through the ``plyx`` entry-point group (``kernels-example``) and
registers through the ``plyx_register_kernels`` hook, exactly like the
built-ins; nothing in plyx imports it. It declares the contracts it was
written against, so an incompatible plyx-specs skips it with a warning.

Implementations:

- ``swiglu:example`` (priority 5, above the reference's 0): silu(gate) * up
  computed in the inputs' own dtype with ``torch.nn.functional.silu``'s
  in-place form, for CPU float32/bfloat16 tensors whose last dimension is a
  multiple of 8. Anything else is refused with the predicate's reason, and the
  registry falls back to the next implementation.
- ``rmsnorm:example-broken`` (priority 50), only when
  ``PLYX_KERNELS_EXAMPLE_BROKEN=1``: deliberately wrong (it forgets the mean in
  the root mean square) to show that the registry's conformance probe refuses
  a third-party kernel that fails the kit, with a warning, instead of using it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from plyx.specs import hookimpl
from plyx.specs.kernels import Capability, KernelImpl

__all__ = ["swiglu", "rmsnorm_broken", "plyx_register_kernels"]

plyx_contracts = {"hooks": "1.0", "kernels": "1.0"}


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the inputs' dtype (the ``swiglu`` contract)."""
    if gate.shape != up.shape:
        raise ValueError(f"kernel `swiglu:example`: argument `up`: shape {tuple(up.shape)} differs from gate's "
                         f"{tuple(gate.shape)}; pass two halves of equal shape")
    out = torch.nn.functional.silu(gate)
    return out.mul_(up) if not (gate.requires_grad or up.requires_grad) else out * up


def rmsnorm_broken(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, residual: Any = None) -> Any:
    """A wrong RMSNorm: divides by the root of the *sum* of squares, not the mean."""
    h = x if residual is None else x + residual
    y = h * torch.rsqrt(h.float().pow(2).sum(-1, keepdim=True) + eps).to(h.dtype) * weight
    return y if residual is None else (y, h)


@hookimpl
def plyx_register_kernels(registry: Any) -> None:
    registry.register(KernelImpl(
        "swiglu", "example", swiglu,
        Capability(devices={"cpu"}, dtypes={"float32", "bfloat16"}, shape_multiple_of={"hidden": 8}),
        priority=5, description="example plugin: silu(gate) * up in the input dtype, CPU, hidden % 8 == 0",
    ))
    if os.environ.get("PLYX_KERNELS_EXAMPLE_BROKEN", "") not in ("", "0"):
        registry.register(KernelImpl(
            "rmsnorm", "example-broken", rmsnorm_broken, Capability(devices={"cpu"}), priority=50,
            description="example plugin: a deliberately wrong RMSNorm (refused by the conformance probe)",
        ))
