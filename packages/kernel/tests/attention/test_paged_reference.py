"""The batched ``paged_attention_reference`` against the per-sequence loop it replaced.

The oracle below is the former implementation, kept tiny: gather each
sequence's blocks in Python, one dense ``attention_reference`` call per
sequence. Inputs are fresh random pools, random block tables whose columns past
a sequence's blocks hold 0 (the ``BlockTable`` convention) or blocks of other
sequences, variable lengths (1, block multiples, others), Tq > 1, GQA/MQA and
sliding windows.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel.attention import paged_attention_reference
from plyx.kernel.attention._reference import paged_attention_per_sequence

from .conftest import rel_err

_loop = paged_attention_per_sequence  # the former reference: one sequence at a time


def _case(B, Tq, H, KV, D, block_size, *, zero_tail, dtype=torch.float64):
    lens = torch.randint(Tq, 6 * block_size + 3, (B,), dtype=torch.int32)
    lens[0] = Tq  # a sequence holding only its new tokens
    if B > 1:
        lens[1] = max(2, -(-Tq // block_size)) * block_size  # an exact multiple of the block size
    max_blocks = -(-int(lens.max()) // block_size) + 1  # a spare column
    num_blocks = B * max_blocks + 2
    k_pool = torch.randn(num_blocks, block_size, KV, D, dtype=dtype)
    v_pool = torch.randn(num_blocks, block_size, KV, D, dtype=dtype)
    tables = torch.randperm(num_blocks)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    if zero_tail:
        used = torch.arange(max_blocks)[None] * block_size < lens[:, None].long()
        tables = torch.where(used, tables, torch.zeros_like(tables))
    q = torch.randn(B, Tq, H, D, dtype=dtype)
    return q, k_pool, v_pool, tables, lens


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("H,KV", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_reference_matches_per_sequence_loop(seed, block_size, Tq, H, KV, window):
    q, k_pool, v_pool, tables, lens = _case(5, Tq, H, KV, 8, block_size, zero_tail=seed % 2 == 0)
    got = paged_attention_reference(q, k_pool, v_pool, tables, lens, window=window)
    ref = _loop(q, k_pool, v_pool, tables, lens, window=window)
    assert got.shape == q.shape and got.dtype == torch.float64
    assert rel_err(got, ref) < 1e-12, f"seed={seed} lens={lens.tolist()}"


def test_batched_reference_scale_and_float32(seed):
    q, k_pool, v_pool, tables, lens = _case(4, 3, 4, 2, 8, 4, zero_tail=True, dtype=torch.float32)
    got = paged_attention_reference(q, k_pool, v_pool, tables, lens, scale=0.3, window=6)
    ref = _loop(q.double(), k_pool.double(), v_pool.double(), tables, lens, scale=0.3, window=6)
    assert got.dtype == torch.float32 and rel_err(got, ref) < 1e-6, seed


def test_batched_reference_gradcheck_float64(seed):
    # a small pool (7 blocks of 2) keeps the numerical Jacobian cheap
    k_pool, v_pool = torch.randn(2, 7, 2, 2, 4, dtype=torch.float64).unbind(0)
    tables = torch.randperm(7)[:6].view(2, 3).to(torch.int32)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    q = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    for t in (q, k_pool, v_pool):
        t.requires_grad_(True)
    fn = lambda q_, k_, v_: paged_attention_reference(q_, k_, v_, tables, lens, window=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k_pool, v_pool)), seed


def test_batched_reference_rejects_a_narrow_table():
    q, k_pool, v_pool, tables, lens = _case(2, 1, 2, 2, 4, 4, zero_tail=True)
    lens[1] = 4 * tables.shape[1] + 1  # one token more than the table can address
    with pytest.raises(ValueError, match="`block_tables` has .* columns"):
        paged_attention_reference(q, k_pool, v_pool, tables, lens)
