"""Property tests: random append / fork / crop / evict / read sequences keep each cache equal to a simple model.

The model is a dict of per-sequence lists of tokens (one random vector per
token and layer). After every step each live sequence reads back exactly its
model, and for the paged cache the block accounting has no leak: used blocks
are exactly the distinct blocks the live sequences hold.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from plyx.attn import ContiguousKVCache, PagedKVCache
from plyx.specs import CacheFullError, CacheLayout

LAYERS, KV, DH, BS, MAX_LEN = 2, 1, 2, 3, 14


def _layout(num_blocks: int) -> CacheLayout:
    return CacheLayout(num_layers=LAYERS, num_kv_heads=KV, head_dim=DH, dtype="float32", device="cpu",
                       max_seq_len=MAX_LEN, block_size=BS, num_blocks=num_blocks)


# no example database: runs do not depend on what an earlier run (or another hypothesis version) stored
_settings = settings(max_examples=60, stateful_step_count=25, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_settings
class CacheMachine(RuleBasedStateMachine):
    kind = "paged"

    def __init__(self) -> None:
        super().__init__()
        if self.kind == "paged":
            self.cache = PagedKVCache(_layout(num_blocks=9))
        else:
            self.cache = ContiguousKVCache(_layout(num_blocks=9), max_batch=4)
        self.model: dict[int, torch.Tensor] = {}  # seq -> [LAYERS, 2, n, KV, DH]
        self.next_id = 0
        self.counter = 0.0

    def _tokens(self, n: int) -> torch.Tensor:
        # distinct values per token so any misplaced slot shows
        vals = torch.arange(self.counter, self.counter + n * LAYERS * 2 * KV * DH)
        self.counter += vals.numel()
        return vals.view(LAYERS, 2, n, KV, DH)

    @rule()
    def allocate(self) -> None:
        try:
            self.cache.allocate(self.next_id)
        except CacheFullError:
            assert self.kind == "contiguous" and len(self.model) == 4
            return
        self.model[self.next_id] = torch.empty(LAYERS, 2, 0, KV, DH)
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))
        counts = [data.draw(st.integers(0, MAX_LEN - self.model[s].shape[2])) for s in ids]
        before = {s: self.cache.length(s) for s in self.model}
        try:
            self.cache.reserve(ids, counts)
        except CacheFullError:
            assert {s: self.cache.length(s) for s in self.model} == before, "a failed reserve changed lengths"
            return
        new = self._tokens(sum(counts))
        for layer in range(LAYERS):
            self.cache.append(layer, ids, new[layer, 0], new[layer, 1])
        start = 0
        for s, n in zip(ids, counts):
            self.model[s] = torch.cat([self.model[s], new[:, :, start : start + n]], dim=2)
            start += n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.model)))
        try:
            self.cache.fork(src, self.next_id)
        except CacheFullError:
            assert self.kind == "contiguous"
            return
        self.model[self.next_id] = self.model[src].clone()
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def crop(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.integers(0, self.model[s].shape[2]))
        self.cache.crop(s, n)
        self.model[s] = self.model[s][:, :, :n]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.evict(s)
        del self.model[s]

    @invariant()
    def reads_match_model(self) -> None:
        assert sorted(self.cache.sequences()) == sorted(self.model)
        for s, want in self.model.items():
            assert self.cache.length(s) == want.shape[2]
            for layer in range(LAYERS):
                k, v = self.cache.read(layer, s)
                assert torch.equal(k, want[layer, 0]) and torch.equal(v, want[layer, 1])

    @invariant()
    def accounting_has_no_leak(self) -> None:
        u = self.cache.usage()
        assert u.blocks_used + u.blocks_free == u.blocks_total
        assert u.num_sequences == len(self.model)
        if self.kind == "paged":
            held = [b for s in self.model for b in self.cache.blocks(s)]
            assert u.blocks_used == len(set(held))
            for b in set(held):
                assert self.cache.refcount(b) == held.count(b)
            for s in self.model:  # a sequence holds exactly the blocks its tokens need
                assert len(self.cache.blocks(s)) == -(-self.model[s].shape[2] // BS)
        else:
            assert u.blocks_used == sum(t.shape[2] for t in self.model.values())


class ContiguousMachine(CacheMachine):  # inherits the settings
    kind = "contiguous"


TestPagedProperties = CacheMachine.TestCase
TestContiguousProperties = ContiguousMachine.TestCase
