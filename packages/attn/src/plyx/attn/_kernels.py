"""Kernel lookup by name: plyx-attn never imports an implementation, it asks the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["kernel"]


def kernel(name: str, *tensors: Any, **shape: int) -> Callable[..., Any]:
    """The implementation of ``name`` the registry selects for ``tensors`` (device, dtype) and ``shape``."""
    import torch

    if torch.compiler.is_compiling():  # an opaque custom op for Inductor (plyx-kernel >= 1.3), not the kernel's code
        # the module itself, not `plyx.kernel.traceable`: the package's names load lazily (PEP 562), which
        # Dynamo need not resolve through the module's __getattr__
        from plyx.kernel._custom_ops import traceable

        op = traceable(name)
        if op is not None:
            return op  # type: ignore[no-any-return]
    from plyx.kernel import registry

    return registry().get(name, *tensors, **shape)
