"""The ``KVCache`` contract: an opaque handle on the keys and values of many sequences.

Designed for a paged cache with prefix sharing and served equally by a
contiguous one. Sequences are named by integer ids chosen by the caller.

A step of a model goes::

    cache.reserve(seq_ids, num_new)            # all-or-nothing, may raise CacheFullError
    for layer in range(n_layers):
        cache.append(layer, seq_ids, k, v)     # k, v: [sum(num_new), KV, Dh]
        ... attention reads cache.read(layer, seq_id) or, for paged kernels,
            cache.kv_pool(layer) with cache.block_table(seq_ids)

Implementations are registered under a kind name through the
``plyx_kv_cache_kinds`` hook and must pass ``plyx.specs.testing.kvcache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
from plyx.specs._versions import CONTRACT_VERSIONS
from plyx.specs.errors import PlyxError

__all__ = ["CONTRACT_VERSION", "BlockTable", "CacheFullError", "CacheLayout", "CacheUsage", "KVCache"]

CONTRACT_VERSION = CONTRACT_VERSIONS["kvcache"]


class CacheFullError(PlyxError, MemoryError):
    """Not enough free blocks (or capacity); the cache is left exactly as it was.

    Attributes:
        needed: blocks (or token slots) the operation needed.
        free: blocks (or token slots) that were free.
    """

    def __init__(self, needed: int, free: int, what: str = "blocks") -> None:
        self.needed = needed
        self.free = free
        super().__init__(
            f"KV cache is full: needed {needed} {what}, {free} free; evict or preempt a sequence and retry "
            f"(nothing was changed)"
        )


@attrs.frozen
class CacheLayout:
    """Static description of a cache.

    Attributes:
        num_layers, num_kv_heads, head_dim: what each token stores per layer.
        dtype: canonical dtype name. device: ``cpu``, ``cuda:0``...
        block_size: tokens per block, or None for a contiguous cache.
        num_blocks: blocks in the pool (paged) or None.
        max_seq_len: most tokens one sequence may hold.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    max_seq_len: int
    block_size: int | None = None
    num_blocks: int | None = None


@attrs.frozen
class CacheUsage:
    """Accounting: blocks and bytes (a contiguous cache reports token slots as blocks of 1)."""

    blocks_total: int
    blocks_used: int
    blocks_free: int
    bytes_total: int
    bytes_used: int
    num_sequences: int


@attrs.frozen
class BlockTable:
    """Page-table access for paged kernels.

    Attributes:
        block_tables: int32 tensor ``[B, max_blocks]``; entry j of row i is the
            pool block holding tokens ``j*block_size ... (j+1)*block_size-1`` of
            sequence i; unused entries are 0 (never read past ``context_lens``).
        context_lens: int32 tensor ``[B]``, tokens stored per sequence.
    """

    block_tables: Any
    context_lens: Any


@runtime_checkable
class KVCache(Protocol):
    """Keys and values of many sequences, addressed by sequence id."""

    @property
    def layout(self) -> CacheLayout:
        """Static sizes, dtype, device and block geometry."""
        ...

    def allocate(self, seq_id: int) -> None:
        """Register an empty sequence; an id already present is a ``ValueError``."""
        ...

    def reserve(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Make room for ``num_tokens[i]`` more tokens of ``seq_ids[i]`` and advance their lengths.

        All or nothing: on ``CacheFullError`` (out of blocks or rows) no sequence
        changed. Growing a sequence past ``layout.max_seq_len`` is a ``ValueError``;
        an unknown id a ``KeyError``; an id twice in one call a ``ValueError``.
        Shared blocks about to be written are copied first (copy-on-write).
        """
        ...

    def append(self, layer: int, seq_ids: Sequence[int], k: Any, v: Any) -> None:
        """Store the keys and values of the slots the last ``reserve`` made.

        ``k``, ``v``: ``[N, num_kv_heads, head_dim]`` with N the sum of the
        reserved counts, sequences in ``seq_ids`` order.
        """
        ...

    def read(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """All stored keys and values of one sequence: two ``[length, KV, Dh]`` tensors."""
        ...

    def length(self, seq_id: int) -> int:
        """Tokens stored for ``seq_id``."""
        ...

    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        ...

    def fork(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` that shares its blocks until either writes (prefix sharing)."""
        ...

    def crop(self, seq_id: int, length: int) -> None:
        """Drop tokens past ``length`` (speculative decoding rollback)."""
        ...

    def evict(self, seq_id: int) -> None:
        """Forget ``seq_id`` and release the blocks no other sequence shares."""
        ...

    def block_table(self, seq_ids: Sequence[int]) -> BlockTable | None:
        """Block tables and lengths of ``seq_ids`` for paged kernels; None for a contiguous cache."""
        ...

    def kv_pool(self, layer: int) -> tuple[Any, Any] | None:
        """The block pools of ``layer`` (``[num_blocks, block_size, KV, Dh]`` each); None if not paged."""
        ...

    def usage(self) -> CacheUsage:
        """Blocks and bytes in use and free."""
        ...
