"""``ContiguousKVCache``: one preallocated row of ``max_seq_len`` slots per sequence.

Layout per layer: ``[max_batch, max_seq_len, KV, Dh]``; a sequence id is mapped
to a free row when allocated. Running out of rows (``allocate``, ``fork``) is a
``CacheFullError``; a sequence growing past ``max_seq_len`` is a ``ValueError``
(a length limit, as in the paged cache). Simple and fast to read for a fixed batch
(offline generation, beam search); ``fork`` copies a row (no sharing) and
``reorder`` permutes beams in one gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from plyx.attn._common import check_kv, dtype_of, unique_ids
from plyx.specs.kvcache import CacheFullError, CacheLayout, CacheUsage

__all__ = ["ContiguousKVCache"]


class ContiguousKVCache:
    """A ``[max_batch, max_seq_len]`` slab per layer; sequences are rows.

    Args:
        layout: sizes (``block_size``/``num_blocks`` are ignored).
        max_batch: rows, i.e. the most live sequences at once.

    Example::

        cache = ContiguousKVCache(layout, max_batch=4)
        cache.allocate(7)
        cache.reserve([7], [3])
        cache.append(0, [7], k, v)      # k, v: [3, KV, Dh]
        k_all, v_all = cache.read(0, 7)
    """

    def __init__(self, layout: CacheLayout, *, max_batch: int = 1) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        self._layout = CacheLayout(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            device=layout.device,
            max_seq_len=layout.max_seq_len,
        )
        self.max_batch = max_batch
        shape = (max_batch, layout.max_seq_len, layout.num_kv_heads, layout.head_dim)
        dtype = dtype_of(layout.dtype)
        self._k = [torch.zeros(shape, dtype=dtype, device=layout.device) for _ in range(layout.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=layout.device) for _ in range(layout.num_layers)]
        self._rows: dict[int, int] = {}  # seq id -> row
        self._lens: dict[int, int] = {}
        self._free_rows = list(range(max_batch - 1, -1, -1))
        # the last reserve: its ids and flat slot ids (host ints until the first append needs a tensor)
        self._pending: tuple[tuple[int, ...], list[int] | torch.Tensor] | None = None
        # static decode steps address the slab as blocks: the largest power of two <= 16 dividing max_seq_len
        S = layout.max_seq_len
        self._block = min(16, S & -S)

    # -- the KVCache contract --------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        return self._layout

    def allocate(self, seq_id: int) -> None:
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id} is already allocated; evict it first or pick another id")
        if not self._free_rows:
            raise CacheFullError(1, 0, what="sequence rows")
        self._rows[seq_id] = self._free_rows.pop()
        self._lens[seq_id] = 0

    def reserve(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        ids = unique_ids(seq_ids)
        counts = [int(n) for n in num_tokens]
        if len(counts) != len(ids):
            raise ValueError(f"reserve got {len(ids)} seq_ids but {len(counts)} num_tokens; pass one count per sequence")
        for sid, n in zip(ids, counts):  # check everything before changing anything
            self._row(sid)
            if n < 0:
                raise ValueError(f"num_tokens for sequence {sid} is {n}; it must be >= 0")
            if self._lens[sid] + n > self._layout.max_seq_len:
                # a row is one sequence's whole room: a length limit, as in the paged cache
                raise ValueError(
                    f"sequence {sid} would hold {self._lens[sid] + n} tokens, more than max_seq_len="
                    f"{self._layout.max_seq_len}; crop it or build the cache with a larger max_seq_len"
                )
        S = self._layout.max_seq_len
        slots: list[int] = []  # slot ids in the [max_batch * max_seq_len] view; host ints, one tensor at the end
        for sid, n in zip(ids, counts):
            start = self._lens[sid]
            base = self._rows[sid] * S
            slots.extend(range(base + start, base + start + n))
            self._lens[sid] = start + n
        self._pending = (tuple(ids), slots)

    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if self._pending is None:
            raise RuntimeError("append() without a matching reserve(); call reserve(seq_ids, num_tokens) first")
        ids, flat = self._pending
        if tuple(seq_ids) != ids:
            raise ValueError(f"append() got seq_ids {list(seq_ids)}, but the last reserve() was for {list(ids)}")
        if isinstance(flat, list):
            flat = torch.tensor(flat, dtype=torch.long).to(self._layout.device)
            self._pending = (ids, flat)
        self._check_layer(layer)
        check_kv(self._layout, k, v, flat.numel())
        kv = (self._layout.num_kv_heads, self._layout.head_dim)
        self._k[layer].view(-1, *kv).index_copy_(0, flat, k.to(self._k[layer].dtype))
        self._v[layer].view(-1, *kv).index_copy_(0, flat, v.to(self._v[layer].dtype))

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer)
        row, n = self._row(seq_id), self._lens[seq_id]
        return self._k[layer][row, :n], self._v[layer][row, :n]

    def length(self, seq_id: int) -> int:
        self._row(seq_id)
        return self._lens[seq_id]

    def sequences(self) -> list[int]:
        return list(self._rows)

    def fork(self, src: int, dst: int) -> None:
        row = self._row(src)
        if dst in self._rows:
            raise ValueError(f"cannot fork {src} into {dst}: sequence {dst} already exists; evict it first")
        self.allocate(dst)
        new, n = self._rows[dst], self._lens[src]
        for pool in (*self._k, *self._v):
            pool[new, :n] = pool[row, :n]
        self._lens[dst] = n

    def crop(self, seq_id: int, length: int) -> None:
        self._row(seq_id)
        if not 0 <= length <= self._lens[seq_id]:
            raise ValueError(f"crop length {length} for sequence {seq_id} must be in [0, {self._lens[seq_id]}]")
        self._lens[seq_id] = length
        self._pending = None

    def evict(self, seq_id: int) -> None:
        row = self._row(seq_id)
        del self._rows[seq_id], self._lens[seq_id]
        self._free_rows.append(row)
        if self._pending is not None and seq_id in self._pending[0]:
            self._pending = None

    def block_table(self, seq_ids: Sequence[int]) -> None:
        return None

    def kv_pool(self, layer: int) -> None:
        return None

    # -- block addressing (static decode steps, see plyx.attn.StaticDecode) ------------
    @property
    def block_size(self) -> int:
        """Tokens per block when the slab is addressed as blocks (a power of two dividing max_seq_len)."""
        return self._block

    def kv_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s slab viewed as ``[max_batch * max_seq_len / block_size, block_size, KV, Dh]`` (no copy):
        row ``r`` is blocks ``r * max_seq_len / block_size`` onwards, so ``paged_attention`` reads it."""
        self._check_layer(layer)
        shape = (-1, self._block, self._layout.num_kv_heads, self._layout.head_dim)
        return self._k[layer].view(shape), self._v[layer].view(shape)

    def seq_blocks(self, seq_id: int) -> Sequence[int]:
        """The block ids holding ``seq_id``'s tokens, in order (consecutive: a sequence is one row)."""
        per_row = self._layout.max_seq_len // self._block
        first = self._row(seq_id) * per_row
        return range(first, first + -(-self._lens[seq_id] // self._block))

    def usage(self) -> CacheUsage:
        slots = self.max_batch * self._layout.max_seq_len
        used = sum(self._lens.values())
        per_slot = 2 * self._layout.num_layers * self._k[0][0, 0].numel() * self._k[0].element_size()
        return CacheUsage(
            blocks_total=slots,
            blocks_used=used,
            blocks_free=slots - used,
            bytes_total=slots * per_slot,
            bytes_used=used * per_slot,
            num_sequences=len(self._rows),
        )

    # -- beam search -----------------------------------------------------------------
    def reorder(self, mapping: Mapping[int, int]) -> None:
        """Make each ``dst`` sequence a copy of ``src`` (``{dst: src}``), all at once.

        Beam search: after a step the surviving beams ``dst`` continue from
        parents ``src``; sources are read before any destination is written,
        so permutations (``{0: 1, 1: 0}``) are safe.
        """
        dsts = list(mapping)
        srcs = [mapping[d] for d in dsts]
        dst_rows = torch.tensor([self._row(d) for d in dsts], dtype=torch.long, device=self._layout.device)
        src_rows = torch.tensor([self._row(s) for s in srcs], dtype=torch.long, device=self._layout.device)
        for pool in (*self._k, *self._v):
            pool[dst_rows] = pool[src_rows]  # the gather on the right is materialised first
        lens = {d: self._lens[s] for d, s in zip(dsts, srcs)}
        self._lens.update(lens)
        self._pending = None

    # -- internals -------------------------------------------------------------------
    def _row(self, seq_id: int) -> int:
        try:
            return self._rows[seq_id]
        except KeyError:
            raise KeyError(
                f"sequence {seq_id} is not in the cache (live: {sorted(self._rows)[:16]}); allocate() it first"
            ) from None

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self._layout.num_layers:
            raise IndexError(f"layer {layer} out of range: the cache holds {self._layout.num_layers} layers")

    def __repr__(self) -> str:
        u = self.usage()
        return f"ContiguousKVCache(rows {len(self._rows)}/{self.max_batch}, slots {u.blocks_used}/{u.blocks_total} used)"
