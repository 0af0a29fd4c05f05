"""``StaticDecode``: one-token decode steps whose every input sits at a fixed address (for CUDA graphs).

A captured CUDA graph replays its kernels on the same memory and runs nothing on the
host. So the host work of a decode step -- reserving one slot per sequence, looking up
its blocks, its position and context length -- is done before the replay and written
into preallocated buffers with one host-to-device copy; the step inside the graph only
reads them::

    bucket = decode.prepare(seq_ids, tokens)       # host: reserve, fill the pinned buffer, copy
    ids, positions, step = decode.inputs(bucket)   # device only: capturable
    logits = model(ids, position_ids=positions, kv_step=step)

Batches are padded to a bucket size (one graph per bucket). Padding rows repeat row 0
(its token, position, slot and block table): they compute and write exactly what row 0
does, so the duplicate writes into row 0's slot carry identical values and no other
sequence's memory is touched.

A step may also feed every row the same number T > 1 of tokens (``max_query``, ``query_len``): a
prompt then goes in as a few such chunks (``plyx.serve``'s ``DecodeGraphs.prefill``), each a replay
instead of an eager forward's few hundred launches from Python.

Or it may be K one-token steps in a row (``steps``): ``prepare`` reserves K tokens per sequence and
loads the positions and slots of all K, ``inputs_steps`` gives each step's views (step k sees the
cache up to its own token), and the caller feeds step k + 1 the token step k chose, on the device
(greedy decoding: ``DecodeGraphs.greedy_steps``). One copy and one replay then serve K tokens.

Any cache with ``block_size``, ``kv_blocks(layer)`` and ``seq_blocks(seq_id)`` works:
``PagedKVCache`` (its pools) and ``ContiguousKVCache`` (its slab seen as blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from plyx.attn._step import KVStep
from plyx.specs.kvcache import KVCache

__all__ = ["STATIC_MAX_QUERY", "StaticDecode", "supports_static_decode"]

#: the most tokens per row of one static step (a prompt chunk) or one-token steps per replay: the paged kernel
#: takes any number of query rows (in tiles of 128 per key/value head, plyx-kernel 1.2), so this only sizes
#: the step buffers; 32 feeds a typical short prompt in one replay
STATIC_MAX_QUERY = 32

_NEEDS = ("block_size", "kv_blocks", "seq_blocks")


def supports_static_decode(cache: object) -> bool:
    """Whether ``cache`` can be addressed by block (``block_size``, ``kv_blocks``, ``seq_blocks``)."""
    return all(hasattr(cache, name) for name in _NEEDS)


class StaticDecode:
    """Fixed device buffers for steps of up to ``max_batch`` sequences of ``cache``, ``query_len`` new tokens each.

    Args:
        cache: a block-addressable KV cache (see ``supports_static_decode``).
        max_batch: the most rows of one step (the largest bucket).
        max_query: the most new tokens per row of one step: 1 for decoding; more lets a prompt be
            fed in static chunks (every row of a chunk has the same count, so nothing is padded
            within a row and the paged kernel's bottom-right causal alignment holds).

    The tensors ``inputs`` returns are views of the buffers: read them before the next ``prepare``.
    """

    def __init__(self, cache: KVCache, *, max_batch: int, max_query: int = 1) -> None:
        if not supports_static_decode(cache):
            missing = [n for n in _NEEDS if not hasattr(cache, n)]
            raise TypeError(
                f"{type(cache).__name__} cannot run static (graph-captured) decode steps: it lacks "
                f"{', '.join(missing)}; use PagedKVCache or ContiguousKVCache, or turn CUDA graphs off"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if not 1 <= max_query <= STATIC_MAX_QUERY:
            raise ValueError(f"max_query must be in [1, {STATIC_MAX_QUERY}] (STATIC_MAX_QUERY); got {max_query}")
        self.cache = cache
        self.max_batch = n = max_batch
        self.max_query = q = max_query
        self.block_size = int(cache.block_size)  # type: ignore[attr-defined]
        self.width = -(-cache.layout.max_seq_len // self.block_size)  # block-table columns
        device = torch.device(cache.layout.device)
        self.device = device
        # one int64 buffer: [row_map | lens] of n each, [positions | slots | tokens] of n*q each, then the
        # [n, width] tables. A step of T tokens per row uses the first bucket*T entries of each n*q part,
        # row-major, so its [bucket, T] views are contiguous.
        self._head = 2 * n + 3 * n * q
        pinned = device.type == "cuda"
        self._host = torch.zeros(self._head + n * self.width, dtype=torch.long, pin_memory=pinned)
        self._dev = torch.zeros(self._host.shape, dtype=torch.long, device=device)
        sizes = (n, n, n * q, n * q, n * q)
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        h = self._host.numpy()
        self._row_map, self._lens, self._pos, self._slots, self._tokens = (
            h[a:b] for a, b in zip(bounds, bounds[1:]))
        self._tables = h[self._head:].reshape(n, self.width)
        d = self._dev
        self.row_map, self.lens, self.positions, self.slots, self._dev_tokens = (
            d[a:b] for a, b in zip(bounds, bounds[1:]))
        self.tables = d[self._head:].view(n, self.width)
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)  # each row's input token (one-token steps)
        # the kernel reads int32 tables and lengths: converted inside the step (so inside the graph)
        self._tables32 = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self._lens32 = torch.zeros(n, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    def prepare(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[Any], bucket: int, *,
                query_len: int = 1, steps: int = 1) -> None:
        """Reserve ``query_len`` tokens for each of ``seq_ids`` and load the step's inputs for ``bucket`` rows.

        ``tokens`` are the new tokens. One per sequence (``query_len=1``): a ``[B]`` long tensor on the
        cache's device (sampled there), or host ints (they travel in the same copy as the rest).
        ``query_len=T > 1``: ``B`` host rows of exactly T ints each (a prompt chunk).
        ``steps=K > 1`` (with ``query_len=1``): K one-token steps in a row (``inputs_steps``); K tokens are
        reserved per sequence and ``tokens`` is the first step's.
        ``bucket`` (>= B, <= max_batch) is the padded batch the step runs with.
        """
        B, T = len(seq_ids), query_len
        if not 1 <= B <= bucket <= self.max_batch:
            raise ValueError(f"need 1 <= batch ({B}) <= bucket ({bucket}) <= max_batch ({self.max_batch})")
        if not 1 <= T <= self.max_query:
            raise ValueError(f"query_len {T} is outside [1, max_query={self.max_query}]")
        if steps > 1 and T > 1:
            raise ValueError("steps > 1 takes one token per row and step (query_len=1)")
        if not 1 <= steps <= self.max_query:
            raise ValueError(f"steps {steps} is outside [1, max_query={self.max_query}] (the buffers' width)")
        on_host = not isinstance(tokens, torch.Tensor)
        if T > 1:
            if not on_host:
                raise TypeError("a step of several tokens per row takes host token rows (lists of ints), not a tensor")
            if len(tokens) != B or any(len(row) != T for row in tokens):
                raise ValueError(f"expected {B} rows of exactly query_len={T} tokens each")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer may still be in flight to the device
        cache = self.cache
        width = T * steps  # tokens reserved per sequence
        cache.reserve(seq_ids, [width] * B)
        bs = self.block_size
        if steps > 1:  # step-major: each step's [bucket] positions and slots are contiguous
            pos = self._pos[:bucket * width].reshape(width, bucket).T
            slots = self._slots[:bucket * width].reshape(width, bucket).T
        else:  # row-major: a chunk's [bucket, T] views are contiguous
            pos = self._pos[:bucket * width].reshape(bucket, width)
            slots = self._slots[:bucket * width].reshape(bucket, width)
        for i, sid in enumerate(seq_ids):
            blocks = cache.seq_blocks(sid)  # type: ignore[attr-defined]
            length = cache.length(sid)
            self._row_map[i] = i
            self._lens[i] = length
            self._tables[i, :len(blocks)] = blocks
            for t, p in enumerate(range(length - width, length)):
                pos[i, t] = p
                slots[i, t] = blocks[p // bs] * bs + p % bs
        if on_host:
            self._tokens[:B * T] = [int(x) for row in tokens for x in row] if T > 1 else tokens
        if bucket > B:  # padding rows repeat row 0
            for part in (pos, slots):
                part[B:bucket] = part[0]
            self._lens[B:bucket] = self._lens[0]
            self._row_map[B:bucket] = 0
            self._tables[B:bucket] = self._tables[0]
            if T > 1:
                self._tokens[B * T:bucket * T] = self._tokens[:T].tolist() * (bucket - B)
        self._dev[:self._head].copy_(self._host[:self._head], non_blocking=True)
        tables = slice(self._head, self._head + bucket * self.width)
        self._dev[tables].copy_(self._host[tables], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if T == 1:
            source = self._dev_tokens[:B] if on_host else tokens.reshape(-1)  # type: ignore[union-attr]
            self.tokens[:B].copy_(source, non_blocking=True)

    def inputs_steps(self, bucket: int, steps: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, KVStep]]]:
        """``(ids [bucket, 1], [(positions [bucket, 1], step)] * steps)`` after ``prepare(..., steps=steps)``.

        ``ids`` feed the first step; the caller feeds step k + 1 what step k chose. Step k reads the
        cache up to its own token (its context lengths are the final ones minus ``steps - 1 - k``).
        Device work only (capturable).
        """
        ids = self._token_ids(bucket)
        tables, lens = self._load_tables(bucket)
        pos = self.positions[:bucket * steps].view(steps, bucket)
        slots = self.slots[:bucket * steps].view(steps, bucket)
        per_step = []
        for k in range(steps):
            step = KVStep(cache=self.cache, seq_ids=(), token_index=None, lengths_before=pos[k], lengths_after=(),
                          paged=(tables, lens - (steps - 1 - k) if k < steps - 1 else lens), key_mask=None,
                          slots=slots[k])
            per_step.append((pos[k][:, None], step))
        return ids, per_step

    def _token_ids(self, bucket: int) -> torch.Tensor:
        """``[bucket, 1]``: each row's one new token, padding rows repeating row 0's."""
        return self.tokens.index_select(0, self.row_map[:bucket])[:, None]

    def _load_tables(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int32 block tables and context lengths the paged kernel reads, converted on the device."""
        self._tables32[:bucket].copy_(self.tables[:bucket])
        self._lens32[:bucket].copy_(self.lens[:bucket])
        return self._tables32[:bucket], self._lens32[:bucket]

    def inputs(self, bucket: int, query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor, KVStep]:
        """``(ids [bucket, T], positions [bucket, T], step)`` for the model; device work only (capturable)."""
        T = query_len
        if T == 1:
            ids = self._token_ids(bucket)
        else:  # host rows, padding included, came in the copy
            ids = self._dev_tokens[:bucket * T].view(bucket, T)
        tables, lens = self._load_tables(bucket)
        positions = self.positions[:bucket * T].view(bucket, T)
        step = KVStep(
            cache=self.cache,
            seq_ids=(),
            token_index=None,
            lengths_before=positions[:, 0],
            lengths_after=(),
            paged=(tables, lens),
            key_mask=None,
            slots=self.slots[:bucket * T],
        )
        return ids, positions, step
