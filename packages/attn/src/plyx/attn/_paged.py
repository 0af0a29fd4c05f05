"""``PagedKVCache``: keys and values in fixed-size blocks of a shared pool, with copy-on-write prefix sharing.

Layout (one pair of pools per layer, the layout ``paged_attention`` reads)::

    k_pool[layer], v_pool[layer]: [num_blocks, block_size, KV, Dh]

A sequence owns a list of block ids (its block table); token ``t`` lives in
block ``table[t // block_size]`` at offset ``t % block_size``. Blocks carry a
reference count: ``fork`` shares every block of the source (refcount + 1) and
the first write into a shared, partly filled last block copies it first
(copy-on-write), so forks cost no memory until they diverge.

Every operation that allocates checks the whole request first and raises
``CacheFullError`` before touching anything, so running out of blocks is
recoverable (evict or preempt, then retry).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from plyx.attn._common import check_kv, dtype_of, layout_dtype_name, unique_ids
from plyx.specs.kvcache import BlockTable, CacheFullError, CacheLayout, CacheUsage

__all__ = ["PagedKVCache"]


class _Seq:
    """Host-side state of one sequence: its blocks and length."""

    __slots__ = ("blocks", "length")

    def __init__(self, blocks: list[int] | None = None, length: int = 0) -> None:
        self.blocks: list[int] = blocks if blocks is not None else []
        self.length = length


class PagedKVCache:
    """A block-pool KV cache with reference-counted, copy-on-write block sharing.

    Args:
        layout: sizes; ``block_size`` and ``num_blocks`` are required.
        device, dtype: override ``layout.device`` / ``layout.dtype``.

    Example::

        cache = PagedKVCache(CacheLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                                         device="cpu", max_seq_len=64, block_size=4, num_blocks=32))
        cache.allocate(0)
        cache.reserve([0], [5])                     # 2 blocks
        for layer in range(2):
            cache.append(layer, [0], k, v)          # k, v: [5, 2, 8]
        cache.fork(0, 1)                            # shares both blocks
        cache.reserve([1], [1])                     # copies block 1 (partly filled, shared)
    """

    def __init__(self, layout: CacheLayout) -> None:
        if layout.block_size is None or layout.num_blocks is None:
            raise ValueError(
                f"PagedKVCache needs layout.block_size and layout.num_blocks (got block_size={layout.block_size}, "
                f"num_blocks={layout.num_blocks}); pass e.g. block_size=16, num_blocks=1024"
            )
        if layout.block_size < 1 or layout.num_blocks < 1:
            raise ValueError(
                f"block_size ({layout.block_size}) and num_blocks ({layout.num_blocks}) must be >= 1"
            )
        self._layout = layout
        self._allocate_pools((layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim))
        self._refs = [0] * layout.num_blocks
        # a stack popped from the end: lowest ids are handed out first (deterministic)
        self._free = list(range(layout.num_blocks - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        # the last reserve: its ids and flat slots (host ints until the first append needs a tensor,
        # so a caller that writes slots itself -- a captured decode step -- pays no host-to-device copy)
        self._pending: tuple[tuple[int, ...], list[int] | torch.Tensor] | None = None
        self._appended: set[int] = set()

    # -- the KVCache contract --------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        return self._layout

    def allocate(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated; evict it first or pick another id")
        self._seqs[seq_id] = _Seq()

    def reserve(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        ids = unique_ids(seq_ids)
        counts = [int(n) for n in num_tokens]
        if len(counts) != len(ids):
            raise ValueError(f"reserve got {len(ids)} seq_ids but {len(counts)} num_tokens; pass one count per sequence")
        plans, needed = self._plan(ids, counts)
        if needed > len(self._free):
            raise CacheFullError(needed, len(self._free))
        # 2. apply: nothing below can fail
        slots: list[int] = []  # host ints, one tensor at the end: per-sequence tensors cost more than the math
        bs = self._layout.block_size
        assert bs is not None
        for (seq, cow, new_blocks), n in zip(plans, counts):
            if cow:
                old = seq.blocks[-1]
                fresh = self._take()
                self._copy_block(old, fresh)
                self._refs[old] -= 1
                seq.blocks[-1] = fresh
            for _ in range(new_blocks):
                seq.blocks.append(self._take())
            blocks = seq.blocks
            # flat slot ids in the [num_blocks * block_size] view of a pool
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(seq.length, seq.length + n))
            seq.length += n
        self._pending = (tuple(ids), slots)
        self._appended = set()

    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots_for(seq_ids)
        self._check_layer(layer)
        check_kv(self._layout, k, v, slots.numel())
        kv = (self._layout.num_kv_heads, self._layout.head_dim)
        self._k[layer].view(-1, *kv).index_copy_(0, slots, k.to(self._k[layer].dtype))
        self._v[layer].view(-1, *kv).index_copy_(0, slots, v.to(self._v[layer].dtype))
        self._appended.add(layer)

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer)
        seq = self._get(seq_id)
        kv = (self._layout.num_kv_heads, self._layout.head_dim)
        if not seq.blocks:
            empty = self._k[layer].new_empty((0, *kv))
            return empty, empty.clone()
        table = torch.tensor(seq.blocks, dtype=torch.long, device=self._k[layer].device)
        k = self._k[layer].index_select(0, table).reshape(-1, *kv)[: seq.length]
        v = self._v[layer].index_select(0, table).reshape(-1, *kv)[: seq.length]
        return k, v

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def fork(self, src: int, dst: int) -> None:
        parent = self._get(src)
        if dst in self._seqs:
            raise ValueError(f"cannot fork {src} into {dst}: sequence {dst} already exists; evict it first")
        for block in parent.blocks:
            self._refs[block] += 1
        self._seqs[dst] = _Seq(list(parent.blocks), parent.length)

    def crop(self, seq_id: int, length: int) -> None:
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise ValueError(f"crop length {length} for sequence {seq_id} must be in [0, {seq.length}]")
        bs = self._layout.block_size
        assert bs is not None
        keep = -(-length // bs)
        for block in seq.blocks[keep:]:
            self._release(block)
        del seq.blocks[keep:]
        seq.length = length
        self._pending = None

    def evict(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        for block in seq.blocks:
            self._release(block)
        del self._seqs[seq_id]
        if self._pending is not None and seq_id in self._pending[0]:
            self._pending = None

    def block_table(self, seq_ids: Sequence[int]) -> BlockTable:
        seqs = [self._get(s) for s in seq_ids]
        width = max([len(s.blocks) for s in seqs] + [1])
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]  # padded with block 0, never read
        table = torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)
        lens = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        device = self._layout.device
        return BlockTable(block_tables=table.to(device), context_lens=lens.to(device))

    def kv_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer)
        return self._k[layer], self._v[layer]

    def usage(self) -> CacheUsage:
        total = self._layout.num_blocks
        assert total is not None
        free = len(self._free)
        per_block = self.bytes_per_block()
        return CacheUsage(
            blocks_total=total,
            blocks_used=total - free,
            blocks_free=free,
            bytes_total=total * per_block,
            bytes_used=(total - free) * per_block,
            num_sequences=len(self._seqs),
        )

    # -- extras for schedulers and prefix caches -------------------------------------
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer, keys and values."""
        first = self._k[0] if self._k else torch.empty(0)
        return 2 * self._layout.num_layers * first[0].numel() * first.element_size() if self._k else 0

    def blocks_needed(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> int:
        """Free blocks ``reserve(seq_ids, num_tokens)`` would take now (copy-on-write copies included)."""
        if len(seq_ids) == 1 and len(num_tokens) == 1:  # a scheduler asks per row, every step: no plan to build
            seq, n = self._seqs.get(seq_ids[0]), int(num_tokens[0])
            if seq is not None and n >= 0 and seq.length + n <= self._layout.max_seq_len:
                bs = self.block_size
                cow = n > 0 and seq.length % bs != 0 and self._refs[seq.blocks[-1]] > 1
                return -(-(seq.length + n) // bs) - len(seq.blocks) + int(cow)
        return self._plan(unique_ids(seq_ids), [int(n) for n in num_tokens])[1]

    def blocks(self, seq_id: int) -> list[int]:
        """The block ids of ``seq_id`` in token order (a copy)."""
        return list(self._get(seq_id).blocks)

    def refcount(self, block: int) -> int:
        """How many sequences hold ``block`` (0 when free)."""
        return self._refs[block]

    def num_free_blocks(self) -> int:
        return len(self._free)

    # -- block addressing (static decode steps, see plyx.attn.StaticDecode) ------------
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        bs = self._layout.block_size
        assert bs is not None
        return bs

    def kv_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s pools as ``[num_blocks, block_size, KV, Dh]`` (the pools themselves)."""
        return self.kv_pool(layer)

    def seq_blocks(self, seq_id: int) -> Sequence[int]:
        """The block ids holding ``seq_id``, in token order (the live list: read it, do not change it)."""
        return self._get(seq_id).blocks

    # -- internals -------------------------------------------------------------------
    def _allocate_pools(self, shape: tuple[int, int, int, int]) -> None:
        """The pools: one tensor per layer and side, ``[num_blocks, block_size, KV, Dh]``."""
        dtype, device = dtype_of(self._layout.dtype), self._layout.device
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self._layout.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self._layout.num_layers)]

    def _copy_block(self, old: int, fresh: int) -> None:
        """Copy-on-write: block ``old``'s contents into ``fresh``, on every layer."""
        for pool in (*self._k, *self._v):
            pool[fresh].copy_(pool[old])

    def _plan(self, ids: list[int], counts: list[int]) -> tuple[list[tuple[_Seq, bool, int]], int]:
        """Per sequence: (state, copy its shared last block?, blocks to add); and the total blocks needed.

        Touches nothing. Two forks sharing a partly filled last block and both
        written in one call: the first copies, the second then owns the block
        alone (the simulated refcount says so) and writes in place.
        """
        bs = self._layout.block_size
        assert bs is not None
        refs: dict[int, int] = {}
        needed = 0
        plans: list[tuple[_Seq, bool, int]] = []
        for sid, n in zip(ids, counts):
            seq = self._get(sid)
            if n < 0:
                raise ValueError(f"num_tokens for sequence {sid} is {n}; it must be >= 0")
            if seq.length + n > self._layout.max_seq_len:
                raise ValueError(
                    f"sequence {sid} would hold {seq.length + n} tokens, more than max_seq_len="
                    f"{self._layout.max_seq_len}; crop it or build the cache with a larger max_seq_len"
                )
            cow = False
            if n > 0 and seq.length % bs:
                last = seq.blocks[-1]
                count = refs.get(last, self._refs[last])
                if count > 1:
                    cow = True
                    refs[last] = count - 1
            new_blocks = -(-(seq.length + n) // bs) - len(seq.blocks)
            needed += new_blocks + int(cow)
            plans.append((seq, cow, new_blocks))
        return plans, needed

    def _get(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(
                f"sequence {seq_id} is not in the cache (live: {sorted(self._seqs)[:16]}); allocate() it first"
            ) from None

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._layout.num_layers:
            raise IndexError(f"layer {layer} out of range: the cache holds {self._layout.num_layers} layers")

    def _slots_for(self, seq_ids: Sequence[int]) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("append() without a matching reserve(); call reserve(seq_ids, num_tokens) first")
        ids, slots = self._pending
        if tuple(seq_ids) != ids:
            raise ValueError(f"append() got seq_ids {list(seq_ids)}, but the last reserve() was for {list(ids)}")
        if isinstance(slots, list):
            slots = torch.tensor(slots, dtype=torch.long).to(self._layout.device)
            self._pending = (ids, slots)
        return slots

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"PagedKVCache(blocks {u.blocks_used}/{u.blocks_total} used, block_size={self._layout.block_size}, "
            f"sequences={u.num_sequences}, dtype={layout_dtype_name(self._layout)})"
        )
