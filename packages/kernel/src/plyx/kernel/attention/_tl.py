"""Triton helpers shared by the attention kernels.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test path) stores
bfloat16 as uint16 and its ``tl.dot`` multiplies those integers (seen with
triton 3.9: a 16x16 bf16 product off by 1e10). Under the interpreter only,
operands are widened to float32 first, which is exactly what the tensor cores
compute (bf16 and fp16 products are exact in float32); compiled kernels use
the 16-bit tensor-core path unchanged.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["mm", "mma", "widen"]

_WIDEN = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mm(a, b):
    """a @ b in float32."""
    if _WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def mma(a, b, acc):
    """acc + a @ b in float32."""
    if _WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def widen(x, dtype: tl.constexpr):
    """``x`` (an int8 or float8 tile) as ``dtype`` for the tensor cores; float32 under the interpreter, whose
    bfloat16 is an integer type (int8 -> bfloat16 there gives garbage)."""
    if _WIDEN:
        return x.to(tl.float32)
    return x.to(dtype)
