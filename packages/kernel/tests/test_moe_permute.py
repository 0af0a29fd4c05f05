"""Triton token permutation against the float64 reference: rows, positions and offsets, and dx."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import moe_permute as reference
from plyx.kernel.triton_ops.moe_permute import moe_permute

from .conftest import GPU, TRITON_DEVICE

# (tokens, D, experts, top-k)
CASES = [(1, 8, 4, 1), (13, 24, 5, 2), (7, 1100, 3, 3), (20, 40, 8, 2)]
if GPU:
    CASES += [(4096, 2048, 64, 8)]


def _ids(t, e, k):
    return torch.rand(t, e).argsort(-1)[:, :k].to(TRITON_DEVICE)  # k distinct experts per token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(parity, make, case, dtype):
    t, d, e, k = case
    parity(moe_permute, reference, [make(t, d, dtype=dtype), _ids(t, e, k)], {"num_experts": e}, grad=(0,),
           dtype=dtype, label=f"moe_permute T={t} D={d} top-{k} of {e}")


def test_rows_are_grouped_by_expert_in_token_order():
    x = torch.arange(4.0, device=TRITON_DEVICE)[:, None].expand(4, 3).contiguous()
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]], device=TRITON_DEVICE)
    xs, positions, offsets = moe_permute(x, ids, num_experts=4)
    assert offsets.tolist() == [0, 3, 5, 8, 8]  # expert 3 gets nothing
    assert xs[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # expert 0: tokens 0, 1, 3; expert 1: 1, 2; expert 2: 0, 2, 3
    assert torch.equal(xs[positions.view(-1)], x.repeat_interleave(2, 0))


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(5, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"moe_permute:triton.*`expert_ids`.*\[T=5, k\]"):
        moe_permute(x, torch.zeros(4, 2, dtype=torch.long, device=TRITON_DEVICE), num_experts=2)
    with pytest.raises(KernelInputError, match=r"`expert_ids`.*not an integer"):
        moe_permute(x, torch.zeros(5, 2, device=TRITON_DEVICE), num_experts=2)
    with pytest.raises(KernelInputError, match=r"moe_permute:reference.*values must be in \[0, 2\)"):
        reference(x, torch.full((5, 1), 2, device=TRITON_DEVICE), num_experts=2)


@pytest.mark.parametrize("case", CASES + [(0, 8, 3, 2), (70, 8, 16, 4), (129, 8, 7, 7)], ids=str)
def test_one_launch_sort_gives_the_reference_integers(case):
    """The Triton sort (one program per expert, two scans) against the reference's device sort: the same
    positions and offsets exactly (stable: token order within each expert), int32 ids too; copy=False
    returns the sort alone."""
    from plyx.kernel.reference.moe_permute import routing_positions as reference_sort
    from plyx.kernel.triton_ops.moe_permute import routing_positions

    t, d, e, k = case
    ids = _ids(t, e, k)
    want = reference_sort(ids, e)
    for got in (routing_positions(ids, e), routing_positions(ids.int(), e)):
        assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu()), case
    xs, positions, offsets = moe_permute(torch.zeros(t, d, device=TRITON_DEVICE), ids, num_experts=e, copy=False)
    assert xs is None and torch.equal(positions.cpu(), want[0].cpu()) and torch.equal(offsets.cpu(), want[1].cpu())
    ref_xs, ref_positions, _ = reference(torch.zeros(t, d, device=TRITON_DEVICE), ids, num_experts=e, copy=False)
    assert ref_xs is None and torch.equal(ref_positions.cpu(), want[0].cpu())
