"""Kernel lookup by name: plyx-attn never imports an implementation, it asks the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["kernel"]


def kernel(name: str, *tensors: Any, **shape: int) -> Callable[..., Any]:
    """The implementation of ``name`` the registry selects for ``tensors`` (device, dtype) and ``shape``."""
    from plyx.kernel import registry

    return registry().get(name, *tensors, **shape)
