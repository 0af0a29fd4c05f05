"""Triton grouped GEMM against the float64 per-expert loop: forward, input and weight gradients."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import grouped_gemm as reference
from plyx.kernel.triton_ops.grouped_gemm import grouped_gemm

from .conftest import GPU, TRITON_DEVICE

# (rows per expert, N, K): the interpreter's tiles are 16 x 32 x 32, so 17, 33 and 40 straddle them;
# empty experts (0 rows) first, in the middle and last; one expert with everything
CASES = [((3, 0, 17, 5), 40, 24), ((0, 33, 1), 20, 48), ((9,), 33, 16), ((2, 2, 2, 2, 2, 0), 8, 8)]
if GPU:
    CASES += [((700, 3, 0, 1300, 64), 1024, 2048), ((1,) * 64, 2048, 1024)]


def _inputs(make, counts, n, k, dtype):
    offsets = torch.tensor([0, *counts]).cumsum(0).to(TRITON_DEVICE)
    return make(sum(counts), k, dtype=dtype), make(len(counts), n, k, dtype=dtype, scale=k ** -0.5), offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_per_expert_loop(parity, make, case, dtype):
    counts, n, k = case
    parity(grouped_gemm, reference, _inputs(make, counts, n, k, dtype), grad=(0, 1), dtype=dtype,
           label=f"grouped_gemm rows {counts} N={n} K={k}")


def test_strided_operands_and_explicit_blocks(parity, make):
    counts = (4, 0, 9)
    x = make(24, sum(counts)).T  # (13, 24) with strides (1, 13)
    w = make(3, 24, 40).transpose(1, 2)  # (3, 40, 24) strided
    offsets = torch.tensor([0, *counts]).cumsum(0).to(TRITON_DEVICE)
    parity(lambda *a: grouped_gemm(*a, blocks=(16, 16, 16, 4, 1)), reference, [x, w, offsets], grad=(0, 1),
           label="strided")


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(5, 8, device=TRITON_DEVICE)
    w = torch.randn(2, 4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"grouped_gemm:triton.*`weight`.*\[E, N, K=8\]"):
        grouped_gemm(x, w[:, :, :7], torch.tensor([0, 2, 5], device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`offsets`.*\[E \+ 1 = 3\]"):
        grouped_gemm(x, w, torch.tensor([0, 5], device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"grouped_gemm:reference.*`offsets`.*rise from 0 to M=5"):
        reference(x, w, torch.tensor([0, 4, 3], device=TRITON_DEVICE))
