"""The Triton paged decode attention against the float64 reference, at small shapes.

Pools are filled with random data everywhere (also in blocks no sequence
owns), block tables are random permutations, and context lengths vary in the
batch, including 1, exact multiples of the block size and lengths that are not.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel.attention import paged_attention_reference, paged_attention_triton
from plyx.kernel.attention._paged import num_splits_for

from .conftest import INTERPRETING, TRITON_DEVICE, rel_err

pytestmark = pytest.mark.skipif(
    not INTERPRETING and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)

#: relative error bounds per dtype (P is rounded to the input dtype once before P @ V)
TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def _cache(lens, Tq, H, KV, D, block_size, dtype, extra_blocks=3, spare_columns=1):
    B = len(lens)
    max_blocks = max(-(-n // block_size) for n in lens) + spare_columns  # spare columns: never read
    num_blocks = B * max_blocks + extra_blocks
    dev = TRITON_DEVICE
    k_pool = torch.randn(num_blocks, block_size, KV, D, device=dev, dtype=dtype)
    v_pool = torch.randn(num_blocks, block_size, KV, D, device=dev, dtype=dtype)
    tables = torch.randperm(num_blocks, device=dev)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    lens_t = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(B, Tq, H, D, device=dev, dtype=dtype)
    return q, k_pool, v_pool, tables, lens_t


def _check(seed, lens, Tq, H, KV, D=64, block_size=16, dtype=torch.float16, spare_columns=1, **kw):
    q, k_pool, v_pool, tables, lens_t = _cache(lens, Tq, H, KV, D, block_size, dtype, spare_columns=spare_columns)
    o = paged_attention_triton(q, k_pool, v_pool, tables, lens_t, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}
    ref = paged_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, lens_t, **ref_kw)
    assert o.shape == q.shape and o.dtype == dtype
    assert rel_err(o, ref) < TOL[dtype], f"seed={seed} lens={lens} Tq={Tq} H={H} KV={KV} D={D} bs={block_size} {kw}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("H,KV", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("Tq", [1, 3])
def test_paged_matches_reference(seed, Tq, H, KV, dtype):
    _check(seed, [Tq, 16, 37, 90], Tq, H, KV, dtype=dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8, None])
def test_paged_split_k(seed, num_splits):
    # long contexts, few sequences: partial results of each split are combined
    _check(seed, [300, 5, 161], 2, 4, 2, num_splits=num_splits)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_paged_block_sizes(seed, block_size):
    _check(seed, [1, 33, 64, 70], 1, 4, 2, block_size=block_size)


def test_paged_head_dim_128(seed):
    _check(seed, [50, 129], 1, 4, 2, D=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_paged_split_by_sequence_length_in_a_wide_table(seed, num_splits):
    """An engine's tables are as wide as max_model_len: each split cuts its own sequence's length (sequences of
    1 to 70 tokens over 20 spare columns; more splits than a short sequence has tiles leaves some empty)."""
    _check(seed, [70, 1, 33, 17], 1, 8, 2, spare_columns=20, num_splits=num_splits)
    _check(seed, [70, 40], 2, 4, 2, spare_columns=20, num_splits=num_splits, window=24)


@pytest.mark.parametrize("window", [1, 4, 50])
def test_paged_sliding_window(seed, window):
    _check(seed, [3, 120, 77], 3, 4, 2, window=window, num_splits=3)


def test_paged_custom_scale(seed):
    _check(seed, [40, 20], 1, 2, 2, scale=0.02)


def test_paged_writes_every_output_element(seed, poison):
    poison()  # output and split workspaces start as NaN
    _check(seed, [2, 200, 45], 2, 8, 2, num_splits=4)
    _check(seed, [17, 3], 1, 4, 4, num_splits=1)


def test_paged_split_count_fills_the_gpu():
    assert num_splits_for(1, 8, 32768, 64, 132) > 1  # one long sequence is split
    assert num_splits_for(64, 8, 32768, 64, 132) == 1  # enough (sequence, head) programs already
    assert num_splits_for(1, 8, 256, 64, 132) == 1  # too short to be worth a second kernel
    assert num_splits_for(32, 4, 720, 64, 132) == 1  # an engine's 32 rows: no split below thousands of tokens
    assert num_splits_for(32, 4, 8192, 64, 132) > 1


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_more_query_rows_than_one_program_takes(seed, poison, num_splits):
    """8 heads per key/value head x 20 new tokens = 160 rows: two row tiles of 128 per head, split or not."""
    poison()
    _check(seed, [200, 41], 20, 8, 1, num_splits=num_splits)
    _check(seed, [33], 32, 8, 2, num_splits=num_splits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_reference_captures_in_a_cuda_graph(seed):
    """The reference runs where no Triton kernel does (float32 on a GPU): inside a CUDA graph it cannot read the
    longest length back, so it gathers the whole table; replays with new lengths equal the eager call."""
    q, k_pool, v_pool, tables, lens = _cache([40, 7, 25], 2, 4, 2, 16, 16, torch.float32, spare_columns=3)
    q, k_pool, v_pool, tables, lens = (t.cuda() for t in (q, k_pool, v_pool, tables, lens))
    paged_attention_reference(q, k_pool, v_pool, tables, lens)  # warm (allocator, kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_reference(q, k_pool, v_pool, tables, lens)
    for new in ([40, 7, 25], [3, 50, 16]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.testing.assert_close(out, paged_attention_reference(q, k_pool, v_pool, tables, lens))
