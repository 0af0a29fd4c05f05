"""ContiguousKVCache specifics: beam-search reorder, row accounting."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import ContiguousKVCache
from plyx.specs import CacheFullError, CacheLayout

LAYOUT = CacheLayout(num_layers=2, num_kv_heads=1, head_dim=3, dtype="float32", device="cpu", max_seq_len=8)


def filled(lengths: dict[int, int]) -> tuple[ContiguousKVCache, dict[int, torch.Tensor]]:
    cache = ContiguousKVCache(LAYOUT, max_batch=4)
    data = {}
    for sid, n in lengths.items():
        cache.allocate(sid)
        cache.reserve([sid], [n])
        data[sid] = torch.randn(n, 1, 3)
        for layer in range(2):
            cache.append(layer, [sid], data[sid] + layer, data[sid] - layer)
    return cache, data


def test_reorder_permutes_beams_at_once() -> None:
    cache, data = filled({0: 3, 1: 5, 2: 2})
    cache.reorder({0: 1, 1: 0, 2: 1})  # swap 0 and 1 (reads before writes), 2 continues beam 1
    for dst, src in ((0, 1), (1, 0), (2, 1)):
        assert cache.length(dst) == data[src].shape[0]
        for layer in range(2):
            k, v = cache.read(layer, dst)
            assert torch.equal(k, data[src] + layer) and torch.equal(v, data[src] - layer)


def test_reorder_then_diverge() -> None:
    cache, data = filled({0: 2, 1: 2})
    cache.reorder({1: 0})
    cache.reserve([0, 1], [1, 1])
    new = torch.randn(2, 1, 3)
    for layer in range(2):
        cache.append(layer, [0, 1], new, new)
    k0, _ = cache.read(0, 0)
    k1, _ = cache.read(0, 1)
    assert torch.equal(k0[:2], k1[:2]) and torch.equal(k0[2], new[0]) and torch.equal(k1[2], new[1])


def test_rows_are_the_sequence_limit() -> None:
    cache, _ = filled({0: 1, 1: 1, 2: 1, 3: 1})
    with pytest.raises(CacheFullError, match="sequence rows"):
        cache.allocate(4)
    cache.evict(2)
    cache.allocate(4)
    assert cache.length(4) == 0 and cache.usage().num_sequences == 4
    with pytest.raises(ValueError, match="more than max_seq_len=8"):
        cache.reserve([4], [9])
    assert cache.length(4) == 0
