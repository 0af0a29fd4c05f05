"""Triton matmul against the float64 reference (the backward reuses the kernel on transposed views)."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import matmul as reference
from plyx.kernel.triton_ops.matmul import matmul

from .conftest import GPU, TRITON_DEVICE

# ([..., M, K], [K, N]): the interpreter's tile is 32, so 33, 40, 65 and 70 straddle it
SHAPES = [((1, 1), (1, 1)), ((3, 17, 40), (40, 33)), ((70, 64), (64, 65))]
if GPU:
    SHAPES += [((1000, 1000), (1000, 1000)), ((2, 300, 4096), (4096, 1027))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_matches_reference(parity, make, shapes, dtype):
    sa, sb = shapes
    a, b = make(*sa, dtype=dtype), make(*sb, dtype=dtype, scale=sb[0] ** -0.5)
    parity(matmul, reference, [a, b], grad=(0, 1), dtype=dtype, label=f"matmul {sa} @ {sb}")


def test_transposed_operands_are_read_in_place(parity, make):
    a = make(40, 33).T  # (33, 40) with strides (1, 33)
    b = make(50, 40).T  # (40, 50)
    parity(matmul, reference, [a, b], grad=(0, 1), label="transposed")


def test_bad_inputs_name_kernel_and_argument():
    a = torch.randn(4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"matmul:triton.*`b`.*first dim 7.*a's last dim 8"):
        matmul(a, torch.randn(7, 3, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`b`.*\[K, N\]"):
        matmul(a, torch.randn(2, 8, 3, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`a`.*\[\.\.\., M, K\]"):
        matmul(torch.randn(8, device=TRITON_DEVICE), torch.randn(8, 3, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`b`.*dtype"):
        matmul(a, torch.randn(8, 3, device=TRITON_DEVICE, dtype=torch.float64))
