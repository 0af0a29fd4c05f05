"""Conformance kit for ``KVCache`` implementations.

Usage (any distribution, any kind)::

    from plyx.specs.testing.kvcache import check_kvcache, CHECKS

    check_kvcache(lambda layout: MyCache(layout))          # runs every check, raises AssertionError

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_my_cache(check):
        check(lambda layout: MyCache(layout))

A cache whose storage is lossy (quantised keys and values) exposes
``storage_roundtrip(x [N, KV, Dh]) -> [N, KV, Dh]``, what ``read`` returns for rows
``x`` once appended (a row's result must depend on that row alone); the checks then
compare reads with it, exactly, instead of with the written values. Its pools are then
read through ``kv_scales(layer)`` (two ``[num_blocks, block_size, KV]`` scale pools): a
stored row is ``pool[block, slot].float() * scale[block, slot, :, None]``.

A factory receives a ``CacheLayout`` (``default_layout()`` unless one is
passed) and returns a fresh, empty cache. The checks drive the contract
exactly as a model does (allocate, reserve, append per layer, read) and
compare against values they wrote; torch is imported inside the functions,
so importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plyx.specs.kvcache import BlockTable, CacheFullError, CacheLayout, CacheUsage, KVCache

__all__ = ["CHECKS", "Factory", "check_kvcache", "default_layout"]

Factory = Callable[[CacheLayout], Any]


def default_layout(device: str = "cpu") -> CacheLayout:
    """2 layers, 2 KV heads of 4 dims, float32; 12 blocks of 4 tokens, at most 16 tokens a sequence."""
    return CacheLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", device=device,
                       max_seq_len=16, block_size=4, num_blocks=12)


def _torch() -> Any:
    import torch

    return torch


def _write(cache: Any, ids: list[int], counts: list[int], gen: Any) -> list[tuple[Any, Any]]:
    """reserve + append random keys/values to every layer; returns them per layer ``[N, KV, Dh]``."""
    torch = _torch()
    lay = cache.layout
    cache.reserve(ids, counts)
    out = []
    for layer in range(lay.num_layers):
        n = sum(counts)
        k = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=gen).to(lay.device)
        v = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=gen).to(lay.device)
        cache.append(layer, ids, k, v)
        out.append((k, v))
    return out


class _Model:
    """The simple model: per sequence and layer, the list of stored keys and values."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.k: dict[int, list[Any]] = {}
        self.v: dict[int, list[Any]] = {}

    def add(self, seq: int) -> None:
        self.k[seq] = [None] * self.layers
        self.v[seq] = [None] * self.layers

    def extend(self, ids: list[int], counts: list[int], written: list[tuple[Any, Any]]) -> None:
        torch = _torch()
        for layer, (k, v) in enumerate(written):
            start = 0
            for sid, n in zip(ids, counts):
                for store, new in ((self.k, k), (self.v, v)):
                    part = new[start : start + n]
                    old = store[sid][layer]
                    store[sid][layer] = part if old is None else torch.cat([old, part])
                start += n

    def check(self, cache: Any, what: str) -> None:
        torch = _torch()
        assert sorted(cache.sequences()) == sorted(self.k), f"{what}: sequences() {sorted(cache.sequences())} != {sorted(self.k)}"
        for sid in self.k:
            for layer in range(self.layers):
                k, v = cache.read(layer, sid)
                want_k, want_v = self.k[sid][layer], self.v[sid][layer]
                n = 0 if want_k is None else want_k.shape[0]
                assert cache.length(sid) == n, f"{what}: length({sid}) = {cache.length(sid)}, expected {n}"
                assert k.shape[0] == n and v.shape[0] == n, f"{what}: read({layer}, {sid}) has {k.shape[0]} tokens, expected {n}"
                if n:
                    lossy = getattr(cache, "storage_roundtrip", None)
                    if lossy is not None:  # quantised storage: reads equal what it makes of the written rows
                        want_k, want_v = lossy(want_k.to(k.device)), lossy(want_v.to(k.device))
                    assert torch.equal(k.cpu(), want_k.cpu().to(k.dtype)), f"{what}: keys of seq {sid} layer {layer} differ"
                    assert torch.equal(v.cpu(), want_v.cpu().to(v.dtype)), f"{what}: values of seq {sid} layer {layer} differ"


def _usage_ok(u: CacheUsage, what: str) -> None:
    assert u.blocks_used + u.blocks_free == u.blocks_total, f"{what}: used {u.blocks_used} + free {u.blocks_free} != total"
    assert 0 <= u.bytes_used <= u.bytes_total, f"{what}: bytes_used {u.bytes_used} outside [0, {u.bytes_total}]"


# -- the checks ------------------------------------------------------------------------
def check_protocol_and_layout(factory: Factory, layout: CacheLayout | None = None) -> None:
    """It satisfies ``KVCache`` and reports the sizes it was built with."""
    layout = layout or default_layout()
    cache = factory(layout)
    assert isinstance(cache, KVCache), f"{type(cache).__name__} does not satisfy plyx.specs.KVCache"
    got = cache.layout
    for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "max_seq_len"):
        assert getattr(got, field) == getattr(layout, field), f"layout.{field}: {getattr(got, field)} != {getattr(layout, field)}"
    assert cache.sequences() == [], "a new cache must hold no sequences"
    u = cache.usage()
    _usage_ok(u, "empty cache")
    assert u.blocks_used == 0 and u.num_sequences == 0, f"a new cache reports usage {u}"


def check_allocate_errors(factory: Factory, layout: CacheLayout | None = None) -> None:
    """Allocating an id twice is a ValueError; unknown ids are KeyErrors; a reserve past max_seq_len or with an
    id twice is a ValueError that changes nothing; append must match the reserve."""
    torch = _torch()
    layout = layout or default_layout()
    cache = factory(layout)
    cache.allocate(3)
    assert cache.length(3) == 0
    for call, exc in ((lambda: cache.allocate(3), ValueError), (lambda: cache.length(99), KeyError),
                      (lambda: cache.evict(99), KeyError), (lambda: cache.reserve([99], [1]), KeyError)):
        try:
            call()
        except exc:
            pass
        else:
            raise AssertionError(f"expected {exc.__name__}")
    for call, what in ((lambda: cache.reserve([3], [layout.max_seq_len + 1]), "a reserve past max_seq_len"),
                       (lambda: cache.reserve([3, 3], [1, 1]), "an id twice in one reserve")):
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what} must raise ValueError")
        assert cache.length(3) == 0, f"{what} changed the sequence"
    cache.reserve([3], [2])
    bad = torch.zeros(5, layout.num_kv_heads, layout.head_dim, device=layout.device)
    try:
        cache.append(0, [3], bad, bad)
    except ValueError:
        pass
    else:
        raise AssertionError("append() of 5 tokens after reserving 2 must raise ValueError")


def check_roundtrip(factory: Factory, layout: CacheLayout | None = None) -> None:
    """What is appended over several steps, to several sequences, reads back exactly, per layer."""
    torch = _torch()
    layout = layout or default_layout()
    cache, model, gen = factory(layout), _Model(layout.num_layers), torch.Generator().manual_seed(0)
    for sid in (10, 11, 12):
        cache.allocate(sid)
        model.add(sid)
    for ids, counts in (([10, 11, 12], [3, 5, 1]), ([10, 12], [1, 4]), ([11, 10, 12], [2, 0, 1]), ([10], [6])):
        model.extend(ids, counts, _write(cache, ids, counts, gen))
        model.check(cache, f"after reserve({ids}, {counts})")
        _usage_ok(cache.usage(), "roundtrip")
    assert cache.usage().num_sequences == 3


def check_fork_is_copy_on_write(factory: Factory, layout: CacheLayout | None = None) -> None:
    """A fork reads like its source; writes to either never show in the other."""
    torch = _torch()
    layout = layout or default_layout()
    cache, model, gen = factory(layout), _Model(layout.num_layers), torch.Generator().manual_seed(1)
    cache.allocate(0)
    model.add(0)
    model.extend([0], [6], _write(cache, [0], [6], gen))
    cache.fork(0, 1)
    model.add(1)
    for store in (model.k, model.v):
        store[1] = [t.clone() for t in store[0]]
    model.check(cache, "right after fork")
    model.extend([1], [3], _write(cache, [1], [3], gen))
    model.check(cache, "after writing the fork")
    model.extend([0], [2], _write(cache, [0], [2], gen))
    model.check(cache, "after writing the source")
    cache.fork(1, 2)
    model.add(2)
    for store in (model.k, model.v):
        store[2] = [t.clone() for t in store[1]]
    model.extend([1, 2], [1, 1], _write(cache, [1, 2], [1, 1], gen))  # both sides of one shared block at once
    model.check(cache, "after writing a fork and its source in one step")
    try:
        cache.fork(0, 1)
    except ValueError:
        pass
    else:
        raise AssertionError("fork into an existing id must raise ValueError")


def check_crop_and_evict(factory: Factory, layout: CacheLayout | None = None) -> None:
    """crop keeps a prefix (and later writes follow it); evict forgets and frees; usage returns to empty."""
    torch = _torch()
    layout = layout or default_layout()
    cache, model, gen = factory(layout), _Model(layout.num_layers), torch.Generator().manual_seed(2)
    for sid in (0, 1):
        cache.allocate(sid)
        model.add(sid)
    model.extend([0, 1], [7, 5], _write(cache, [0, 1], [7, 5], gen))
    cache.fork(0, 2)
    model.add(2)
    for store in (model.k, model.v):
        store[2] = [t.clone() for t in store[0]]
    cache.crop(0, 3)
    for store in (model.k, model.v):
        store[0] = [t[:3] for t in store[0]]
    model.check(cache, "after crop")
    model.extend([0], [2], _write(cache, [0], [2], gen))
    model.check(cache, "after writing past a crop")
    cache.evict(1)
    del model.k[1], model.v[1]
    model.check(cache, "after evict")
    for sid in (0, 2):
        cache.evict(sid)
    u = cache.usage()
    _usage_ok(u, "after evicting everything")
    assert u.blocks_used == 0 and u.num_sequences == 0, f"evicting every sequence must free everything, usage is {u}"


def check_full_is_recoverable(factory: Factory, layout: CacheLayout | None = None) -> None:
    """Filling the cache raises CacheFullError and changes nothing; after an evict the same reserve succeeds."""
    torch = _torch()
    layout = layout or default_layout()
    cache, model, gen = factory(layout), _Model(layout.num_layers), torch.Generator().manual_seed(3)
    sid, full = 0, None
    cache.allocate(sid)
    model.add(sid)
    for _ in range(10_000):
        room = layout.max_seq_len - cache.length(sid)
        if room == 0:
            try:
                cache.allocate(sid + 1)
            except CacheFullError as exc:  # out of sequence slots is "full" too
                full = exc
                break
            sid += 1
            model.add(sid)
            continue
        n = min(3, room)
        before = cache.usage()
        try:
            cache.reserve([sid], [n])
        except CacheFullError as exc:
            full = exc
            assert cache.usage() == before, f"usage changed by a failed reserve: {before} -> {cache.usage()}"
            break
        cache.crop(sid, cache.length(sid) - n)  # undo, then write for real through the model
        model.extend([sid], [n], _write(cache, [sid], [n], gen))
    assert full is not None, "the cache never reported CacheFullError"
    assert full.needed > full.free, f"CacheFullError(needed={full.needed}, free={full.free}) is inconsistent"
    model.check(cache, "after CacheFullError")
    # a batch where the first sequence fits and the second does not changes neither
    if len(model.k) >= 2:
        first = min(model.k)
        if cache.length(first) > 0:
            cache.crop(first, cache.length(first) - 1)
            for store in (model.k, model.v):
                store[first] = [t[:-1] for t in store[first]]
        before = cache.usage()
        try:
            cache.reserve([first, sid], [1, layout.max_seq_len - cache.length(sid)])
        except CacheFullError:
            assert cache.usage() == before, "a failed multi-sequence reserve changed usage"
            model.check(cache, "after a failed multi-sequence reserve")
        except ValueError:
            pass
        else:
            cache.crop(first, cache.length(first) - 1)
            cache.crop(sid, model.k[sid][0].shape[0] if model.k[sid][0] is not None else 0)
    victim = min(model.k)
    cache.evict(victim)
    del model.k[victim], model.v[victim]
    fresh = max(model.k, default=0) + 100
    cache.allocate(fresh)
    model.add(fresh)
    model.extend([fresh], [1], _write(cache, [fresh], [1], gen))
    model.check(cache, "after evicting and writing again")


def check_block_table(factory: Factory, layout: CacheLayout | None = None) -> None:
    """For a paged cache, ``kv_pool`` through ``block_table`` holds exactly what ``read`` returns."""
    torch = _torch()
    layout = layout or default_layout()
    cache, gen = factory(layout), torch.Generator().manual_seed(4)
    for sid in (0, 1):
        cache.allocate(sid)
    _write(cache, [0, 1], [5, 2], gen)
    cache.fork(0, 2)
    _write(cache, [2, 1], [2, 3], gen)
    table = cache.block_table([0, 1, 2])
    pool = cache.kv_pool(0)
    if table is None or pool is None:
        assert table is None and pool is None, "block_table and kv_pool must both be None (contiguous) or both set"
        return
    assert isinstance(table, BlockTable)
    bt, lens = table.block_tables, table.context_lens
    assert bt.dtype == torch.int32 and lens.dtype == torch.int32, "block_tables and context_lens must be int32"
    assert lens.tolist() == [cache.length(s) for s in (0, 1, 2)], f"context_lens {lens.tolist()} != lengths"
    block = layout.block_size
    for layer in range(layout.num_layers):
        k_pool, v_pool = cache.kv_pool(layer)
        assert tuple(k_pool.shape[1:]) == (block, layout.num_kv_heads, layout.head_dim), f"pool shape {tuple(k_pool.shape)}"
        for row, sid in enumerate((0, 1, 2)):
            n = cache.length(sid)
            blocks = bt[row, : -(-n // block)].long()
            k = k_pool[blocks].reshape(-1, layout.num_kv_heads, layout.head_dim)[:n]
            v = v_pool[blocks].reshape(-1, layout.num_kv_heads, layout.head_dim)[:n]
            rk, rv = cache.read(layer, sid)
            scales = getattr(cache, "kv_scales", None)
            if scales is not None:  # quantised pools: a row holds pool * scale (one scale per token and head)
                k_s, v_s = (s[blocks].reshape(-1, layout.num_kv_heads)[:n] for s in scales(layer))
                k = (k.to(torch.float32) * k_s[..., None]).to(rk.dtype)
                v = (v.to(torch.float32) * v_s[..., None]).to(rv.dtype)
            assert torch.equal(k, rk) and torch.equal(v, rv), f"pool via block table != read() for seq {sid} layer {layer}"


CHECKS = (
    check_protocol_and_layout,
    check_allocate_errors,
    check_roundtrip,
    check_fork_is_copy_on_write,
    check_crop_and_evict,
    check_full_is_recoverable,
    check_block_table,
)


def check_kvcache(factory: Factory, layout: CacheLayout | None = None) -> list[str]:
    """Run every check on caches built by ``factory``; returns the names passed, raises on the first failure."""
    passed = []
    for check in CHECKS:
        check(factory, layout)
        passed.append(check.__name__)
    return passed
