"""Triton SwiGLU against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import swiglu as reference
from plyx.kernel.triton_ops.swiglu import swiglu

from .conftest import GPU, TRITON_DEVICE

# the interpreter's block is 128 columns: 129 and 300 straddle it
SHAPES = [(1, 1), (5, 67), (3, 129), (2, 3, 300)]
if GPU:
    SHAPES += [(64, 14336), (17, 1025)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(parity, make, shape, dtype):
    g = make(*shape, dtype=dtype, scale=3.0)
    u = make(*shape, dtype=dtype)
    parity(swiglu, reference, [g, u], grad=(0, 1), dtype=dtype, label=f"swiglu {shape}")


def test_halves_of_a_fused_projection_are_read_without_copy(parity, make):
    gu = make(4, 2, 2 * 130)
    gate, up = gu.chunk(2, dim=-1)  # views with row stride 260
    assert not gate.is_contiguous()
    parity(swiglu, reference, [gate, up], grad=(0, 1), label="chunked")


def test_bad_inputs_name_kernel_and_argument():
    g = torch.randn(4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"swiglu:triton.*`up`.*\[4, 9\]"):
        swiglu(g, torch.randn(4, 9, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`up`.*dtype"):
        swiglu(g, torch.randn(4, 8, device=TRITON_DEVICE, dtype=torch.float64))
    with pytest.raises(KernelInputError, match=r"`gate`.*stride"):
        swiglu(torch.randn(8, 4, device=TRITON_DEVICE).T, g)
