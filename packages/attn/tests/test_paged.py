"""PagedKVCache specifics: block sharing, copy-on-write, accounting, errors."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import PagedKVCache, make_cache
from plyx.specs import CacheFullError, CacheLayout

KV, DH, BS = 2, 4, 4


def layout(num_blocks: int = 8, max_seq_len: int = 32, layers: int = 2) -> CacheLayout:
    return CacheLayout(num_layers=layers, num_kv_heads=KV, head_dim=DH, dtype="float32", device="cpu",
                       max_seq_len=max_seq_len, block_size=BS, num_blocks=num_blocks)


def write(cache: PagedKVCache, ids: list[int], counts: list[int]) -> torch.Tensor:
    cache.reserve(ids, counts)
    k = torch.randn(sum(counts), KV, DH)
    for layer in range(cache.layout.num_layers):
        cache.append(layer, ids, k + layer, -k - layer)
    return k


def test_fork_shares_blocks_until_written() -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    k = write(cache, [0], [6])  # blocks: [a (full), b (2 of 4)]
    assert cache.usage().blocks_used == 2
    cache.fork(0, 1)
    assert cache.usage().blocks_used == 2, "a fork must not take blocks"
    assert cache.blocks(1) == cache.blocks(0)
    assert all(cache.refcount(b) == 2 for b in cache.blocks(0))
    k1 = write(cache, [1], [1])  # writes into shared block b: copy on write
    assert cache.usage().blocks_used == 3
    assert cache.blocks(1)[0] == cache.blocks(0)[0], "the full first block stays shared"
    assert cache.blocks(1)[1] != cache.blocks(0)[1]
    assert cache.refcount(cache.blocks(0)[1]) == 1
    src_k, _ = cache.read(0, 0)
    fork_k, _ = cache.read(0, 1)
    assert torch.equal(src_k, k)
    assert torch.equal(fork_k, torch.cat([k, k1]))


def test_fork_at_block_boundary_needs_no_copy() -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    write(cache, [0], [8])  # exactly two full blocks
    cache.fork(0, 1)
    write(cache, [1], [1])
    assert cache.usage().blocks_used == 3  # one fresh block, no copy
    assert cache.blocks(1)[:2] == cache.blocks(0)


def test_evict_releases_only_unshared_blocks() -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    write(cache, [0], [8])
    cache.fork(0, 1)
    cache.evict(0)
    assert cache.usage().blocks_used == 2, "blocks still held by the fork must stay"
    assert all(cache.refcount(b) == 1 for b in cache.blocks(1))
    cache.evict(1)
    assert cache.usage().blocks_used == 0


def test_cache_full_names_sizes_and_changes_nothing() -> None:
    cache = PagedKVCache(layout(num_blocks=3))
    for s in (0, 1):
        cache.allocate(s)
    write(cache, [0], [8])
    before_blocks, before_usage = cache.blocks(0), cache.usage()
    with pytest.raises(CacheFullError, match="needed 2 blocks, 1 free") as info:
        cache.reserve([0, 1], [1, 4])  # 1 block for seq 0 fits, seq 1 makes it 2
    assert (info.value.needed, info.value.free) == (2, 1)
    assert isinstance(info.value, MemoryError)
    assert cache.usage() == before_usage and cache.blocks(0) == before_blocks
    assert cache.length(0) == 8 and cache.length(1) == 0
    write(cache, [0, 1], [1, 0])  # what fits still works


def test_blocks_needed_predicts_reserve() -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    write(cache, [0], [5])
    cache.fork(0, 1)
    cache.fork(0, 2)
    need = cache.blocks_needed([1, 2, 0], [3, 1, 4])
    free = cache.num_free_blocks()
    write(cache, [1, 2, 0], [3, 1, 4])
    # forks 1 and 2 each copy the shared partly filled block; the source then owns it alone
    # and writes in place, needing one new block for its 9th token: 1 + 1 + 1
    assert free - cache.num_free_blocks() == need == 3


def test_blocks_needed_of_one_sequence_predicts_reserve() -> None:
    """The one-sequence shortcut (a scheduler's per-row question) agrees with reserve: block boundaries, shared
    partly filled blocks (copy-on-write), zero tokens."""
    import random

    rng = random.Random(0)
    for trial in range(40):
        cache = PagedKVCache(layout(num_blocks=64, max_seq_len=64))
        cache.allocate(0)
        write(cache, [0], [rng.randrange(1, 12)])
        if trial % 2:
            cache.fork(0, 1)  # the source's last block is shared: its next write copies it unless full
        sid = rng.choice(cache.sequences())
        n = rng.randrange(0, 9)
        need = cache.blocks_needed([sid], [n])
        free = cache.num_free_blocks()
        cache.reserve([sid], [n])
        assert free - cache.num_free_blocks() == need, (trial, sid, n)


def test_accounting_in_bytes() -> None:
    cache = PagedKVCache(layout(num_blocks=5, layers=3))
    per_block = 2 * 3 * BS * KV * DH * 4  # k and v, 3 layers, float32
    assert cache.bytes_per_block() == per_block
    cache.allocate(0)
    write(cache, [0], [5])
    u = cache.usage()
    assert (u.blocks_total, u.blocks_used, u.blocks_free) == (5, 2, 3)
    assert (u.bytes_total, u.bytes_used) == (5 * per_block, 2 * per_block)


def test_block_table_rows() -> None:
    cache = PagedKVCache(layout())
    for s in (4, 9):
        cache.allocate(s)
    write(cache, [4, 9], [9, 2])
    table = cache.block_table([9, 4])
    assert table.block_tables.dtype == torch.int32 and table.block_tables.shape == (2, 3)
    assert table.context_lens.tolist() == [2, 9]
    assert table.block_tables[1].tolist() == cache.blocks(4)
    assert table.block_tables[0, 0].item() == cache.blocks(9)[0]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c: c.reserve([0], [40]), ValueError, "max_seq_len=32"),
        (lambda c: c.reserve([0, 0], [1, 1]), ValueError, "repeat"),
        (lambda c: c.reserve([0], [1, 2]), ValueError, "one count per sequence"),
        (lambda c: c.reserve([7], [1]), KeyError, "allocate"),
        (lambda c: c.crop(0, 5), ValueError, r"\[0, 0\]"),
        (lambda c: c.read(5, 0), IndexError, "2 layers"),
        (lambda c: c.append(0, [0], torch.zeros(1, KV, DH), torch.zeros(1, KV, DH)), RuntimeError, "reserve"),
    ],
)
def test_bad_calls_name_the_problem(call, error, match) -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    with pytest.raises(error, match=match):
        call(cache)


def test_append_shape_checked() -> None:
    cache = PagedKVCache(layout())
    cache.allocate(0)
    cache.reserve([0], [3])
    with pytest.raises(ValueError, match=r"expected \[N, KV, Dh\] = \[3, 2, 4\]"):
        cache.append(0, [0], torch.zeros(3, KV + 1, DH), torch.zeros(3, KV + 1, DH))
    with pytest.raises(ValueError, match="last reserve"):
        cache.append(0, [1], torch.zeros(3, KV, DH), torch.zeros(3, KV, DH))


def test_make_cache_sizes_from_config(tiny_config) -> None:
    cache = make_cache("paged", tiny_config, batch_size=3, block_size=8, max_seq_len=20)
    lay = cache.layout
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim) == (2, 2, 8)
    assert lay.num_blocks == 3 * 3 and lay.block_size == 8 and lay.max_seq_len == 20
    contiguous = make_cache("contiguous", tiny_config, batch_size=3, dtype=torch.bfloat16)
    assert contiguous.max_batch == 3 and contiguous.layout.dtype == "bfloat16"
    with pytest.raises(LookupError, match="misspelled or not installed.*contiguous, paged"):
        make_cache("pagd", tiny_config)
