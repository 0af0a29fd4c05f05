"""Triton forward and backward kernels, one op per file, registered for CUDA.

Importing this package does not import triton; ``register`` only declares the
implementations (their predicates require the ``triton`` module and a CUDA
device of compute capability 8.0 or newer), and each op module imports triton
when it is first called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register(registry: Any) -> None:
    from plyx.kernel.triton_ops._registration import register_all

    register_all(registry)
