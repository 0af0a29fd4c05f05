"""Triton weighted un-permutation against the float64 reference: output, dys and dweights."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import moe_unpermute as reference
from plyx.kernel.triton_ops.moe_unpermute import moe_unpermute

from .conftest import GPU, TRITON_DEVICE

# (tokens, D, top-k)
CASES = [(1, 8, 1), (11, 24, 2), (5, 1100, 4), (9, 33, 3)]
if GPU:
    CASES += [(4096, 2048, 8)]


@pytest.mark.parametrize("wdtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(parity, make, case, dtype, wdtype):
    t, d, k = case
    positions = torch.randperm(t * k).view(t, k).to(TRITON_DEVICE)
    weights = torch.rand(t, k).to(TRITON_DEVICE, dtype if wdtype == "same" else torch.float32)
    parity(moe_unpermute, reference, [make(t * k, d, dtype=dtype), positions, weights], grad=(0, 2), dtype=dtype,
           label=f"moe_unpermute T={t} D={d} top-{k} weights {weights.dtype}")


def test_bad_inputs_name_kernel_and_argument():
    ys = torch.randn(6, 8, device=TRITON_DEVICE)
    pos = torch.arange(6, device=TRITON_DEVICE).view(3, 2)
    with pytest.raises(KernelInputError, match=r"moe_unpermute:triton.*`weights`.*differs from positions'"):
        moe_unpermute(ys, pos, torch.ones(3, 3, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`positions`.*T\*k = 6"):
        moe_unpermute(ys, pos[:2], torch.ones(2, 2, device=TRITON_DEVICE))
