"""``PrefixCache``: full KV blocks of past prompts, keyed by their tokens, reused by later requests.

A block is identified by the exact tokens of every block before it and its own
(vLLM's "hash of parent hash + block tokens"); here the key is
``(parent node, tuple of the block's tokens)`` in a dict, so equal keys are
compared exactly and a hash collision can never hand out the wrong keys and values.

Blocks are kept alive by *holder sequences* in the paged cache: the node of
depth d owns a sequence that is a fork of the request that computed it, cropped
to ``(d + 1) * block_size`` tokens, so it holds one reference on each of the
blocks 0..d (forks share blocks, so holders cost no memory). A new request whose
prompt starts with the same blocks forks the deepest matching holder and only
computes the rest.

Eviction (when the scheduler runs out of free blocks) takes leaves in least
recently used order, and only leaves whose block has a reference count of 1,
i.e. is held by the prefix cache alone: a block some running sequence still
reads is never evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

__all__ = ["PrefixCache", "PrefixNode"]

#: holder sequence ids live far above request sequence ids, so the two never collide
HOLDER_ID_BASE = 1 << 40


class PrefixNode:
    """One cached block: its key, parent, holder sequence and the physical block id."""

    __slots__ = ("block", "children", "depth", "holder", "key", "last_used", "parent")

    def __init__(self, key: tuple[Any, tuple[int, ...]], parent: PrefixNode | None, holder: int, block: int,
                 depth: int, tick: int) -> None:
        self.key = key
        self.parent = parent
        self.holder = holder
        self.block = block
        self.depth = depth
        self.children = 0
        self.last_used = tick


class PrefixCache:
    """Hash-keyed full blocks of prompts over a ``plyx.attn.PagedKVCache``.

    Args:
        cache: the paged cache (needs ``fork``, ``crop``, ``evict``, ``blocks`` and ``refcount``).
        block_size: tokens per block (the cache's).

    Example::

        pc = PrefixCache(cache, block_size=16)
        nodes = pc.match(prompt_ids, max_tokens=len(prompt_ids) - 1)
        if nodes:
            pc.attach(nodes, seq_id)              # seq_id now holds len(nodes) * 16 cached tokens
        ...                                       # after computing the prompt:
        pc.insert(seq_id, prompt_ids, computed=len(prompt_ids))
    """

    def __init__(self, cache: Any, block_size: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self._nodes: dict[tuple[Any, tuple[int, ...]], PrefixNode] = {}
        self._ids = itertools.count(HOLDER_ID_BASE)
        self._tick = itertools.count()
        self.queried_tokens = 0
        """Prompt tokens looked up (the denominator of the hit rate)."""
        self.hit_tokens = 0
        """Of those, tokens found cached."""
        self.evicted_blocks = 0

    # -- lookups -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int) -> list[PrefixNode]:
        """The cached nodes of the longest run of full blocks of ``tokens`` (at most ``max_tokens`` tokens)."""
        bs = self.block_size
        nodes: list[PrefixNode] = []
        parent: PrefixNode | None = None
        tick = next(self._tick)
        for start in range(0, max_tokens - bs + 1, bs):
            node = self._nodes.get((parent, tuple(tokens[start:start + bs])))
            if node is None:
                break
            node.last_used = tick
            nodes.append(node)
            parent = node
        return nodes

    def record(self, queried: int, hit: int) -> None:
        """Count one admission's prompt tokens and how many came from the cache."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens looked up (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def attach(self, nodes: Sequence[PrefixNode], seq_id: int) -> int:
        """Make ``seq_id`` (not in the cache yet) hold the blocks of ``nodes``; returns its cached length."""
        self.cache.fork(nodes[-1].holder, seq_id)
        return len(nodes) * self.block_size

    # -- inserts ---------------------------------------------------------------------------
    def insert(self, seq_id: int, tokens: Sequence[int], computed: int, start: PrefixNode | None = None,
               start_depth: int = 0) -> PrefixNode | None:
        """Register the full blocks of ``tokens[:computed]`` of live sequence ``seq_id``.

        ``start`` / ``start_depth``: the deepest node already known for this sequence (walk from there).
        Returns the deepest node of the sequence after the insert.
        """
        bs = self.block_size
        parent = start
        blocks = None
        tick = next(self._tick)
        for depth in range(start_depth, computed // bs):
            key = (parent, tuple(tokens[depth * bs:(depth + 1) * bs]))
            node = self._nodes.get(key)
            if node is None:
                if blocks is None:
                    blocks = self.cache.blocks(seq_id)
                holder = next(self._ids)
                # fork shares every block of the sequence; crop gives back all but the first depth + 1
                self.cache.fork(seq_id, holder)
                self.cache.crop(holder, (depth + 1) * bs)
                node = PrefixNode(key, parent, holder, blocks[depth], depth, tick)
                self._nodes[key] = node
                if parent is not None:
                    parent.children += 1
            node.last_used = tick
            parent = node
        return parent

    # -- eviction --------------------------------------------------------------------------
    def evict(self, blocks: int) -> int:
        """Free up to ``blocks`` blocks by dropping LRU leaves held by the prefix cache alone; returns freed.

        A heap of evictable leaves by last use; a parent whose last child goes becomes a candidate in turn.
        """
        def evictable(node: PrefixNode) -> bool:
            return node.children == 0 and self.cache.refcount(node.block) == 1

        heap = [(n.last_used, n.holder, n) for n in self._nodes.values() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < blocks and heap:
            _, _, node = heapq.heappop(heap)
            if self._nodes.get(node.key) is not node or not evictable(node):
                continue
            self._drop(node)
            freed += 1
            parent = node.parent
            if parent is not None and evictable(parent):
                heapq.heappush(heap, (parent.last_used, parent.holder, parent))
        self.evicted_blocks += freed
        return freed

    def clear(self) -> None:
        """Drop every entry (blocks still read by running sequences stay theirs)."""
        for node in list(self._nodes.values()):
            self.cache.evict(node.holder)
        self._nodes.clear()

    def _drop(self, node: PrefixNode) -> None:
        self.cache.evict(node.holder)
        del self._nodes[node.key]
        if node.parent is not None:
            node.parent.children -= 1

    def __len__(self) -> int:
        return len(self._nodes)
