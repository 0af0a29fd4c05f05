"""Triton RMSNorm (with and without the fused residual add) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import rmsnorm as reference
from plyx.kernel.triton_ops.rmsnorm import rmsnorm

from .conftest import GPU, TRITON_DEVICE

# hidden sizes (D=1 is left out: its gradient is pure cancellation, eps/(x^2+eps)): tiny, odd, one past a power of two (the masked tail of BLOCK), a power of two
SHAPES = [(1, 5), (4, 37), (3, 5, 130), (7, 257), (2, 256)]
if GPU:
    SHAPES += [(64, 4096), (33, 5120), (5, 14336)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(parity, make, shape, dtype, residual):
    x = make(*shape, dtype=dtype)
    w = make(shape[-1], dtype=dtype, scale=0.1, shift=1.0)
    if residual:
        r = make(*shape, dtype=dtype)
        parity(lambda x, w, r: rmsnorm(x, w, eps=1e-5, residual=r), lambda x, w, r: reference(x, w, eps=1e-5, residual=r),
               [x, w, r], grad=(0, 1, 2), dtype=dtype, label=f"rmsnorm residual {shape}")
    else:
        parity(lambda x, w: rmsnorm(x, w, eps=1e-5), lambda x, w: reference(x, w, eps=1e-5), [x, w], grad=(0, 1),
               dtype=dtype, label=f"rmsnorm {shape}")


def test_strided_rows_are_read_in_place(parity, make):
    base = make(6, 80)
    x = base[:, :40]  # row stride 80, last dim contiguous
    w = make(40)
    parity(lambda x, w: rmsnorm(x, w), lambda x, w: reference(x, w), [x, w], grad=(0, 1), label="strided rows")


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"rmsnorm:triton.*`weight`.*\[8\]"):
        rmsnorm(x, torch.ones(7, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`x`.*int64"):
        rmsnorm(torch.ones(4, 8, dtype=torch.long, device=TRITON_DEVICE), torch.ones(8, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`x`.*stride 4.*contiguous"):
        rmsnorm(torch.randn(8, 4, device=TRITON_DEVICE).T, torch.ones(8, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`residual`.*shape"):
        rmsnorm(x, torch.ones(8, device=TRITON_DEVICE), residual=torch.randn(4, 9, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`eps`"):
        reference(x, torch.ones(8, device=TRITON_DEVICE), eps=-1.0)
    with pytest.raises(KernelInputError, match=r"`weight`: is on meta but `x` is on"):
        reference(x, torch.ones(8, device="meta"))
