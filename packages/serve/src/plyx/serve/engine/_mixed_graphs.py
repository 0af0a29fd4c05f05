"""``MixedGraphs``: the engine's packed steps (prefill chunks + decode rows) as replayed CUDA graphs.

A mixed step feeds each scheduled sequence its next ``n_i`` tokens (1 for a decode row, a prompt
chunk for a prefilling one). Run eagerly, the ``N = sum n_i`` tokens cost ~200 launches from
Python per step (28.6 ms of host time against 2.8 ms of GPU time for a 1.1B model on an H100),
and every new ``N`` may make Triton compile a new specialisation mid-serving.

Here the step is one **full graph per token-count bucket** (16, 32, 48, ... up to
``max_tokens``): every token is one row of a ``[bucket, 1]`` batch, and attention reads the
paged cache per token, each with its own block table (its sequence's) and context length
(its position + 1). A decode row is exactly today's decode; a chunk token at position ``p``
attends keys ``0..p`` of its sequence (causal within the chunk, because every key of the
step is written before any layer attends). So the step's shape depends on the bucket alone:
the paged kernel's grid, the GEMMs and every other kernel are fixed per bucket, and all
per-step metadata (ids, positions, slots, per-row block tables) sits in static device
buffers filled by one host-to-device copy. Padding tokens repeat token 0 (its id, position,
slot and table), so they write exactly what token 0 writes and touch nothing else.

The per-token tables are gathered on the device inside the graph (``row_tables[token_row]``):
the host copies one table per sequence, not per token.

Every bucket is captured when the engine starts (``warm_up``: one eager forward, which also
compiles the Triton kernels, then the capture, per bucket) on a scratch sequence that is
freed afterwards; serving then never compiles. Without CUDA (``capture=False``) the same
static step runs eagerly: the path the CPU tests compare with the unpadded packed step.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from plyx.serve._graphs import BucketGraphs

__all__ = ["MAX_GRAPH_TOKENS", "MixedGraphs", "mixed_buckets"]

#: the scratch sequence id ``warm_up`` runs on (engine ids count up from 0)
_SCRATCH_ID = -(1 << 40)

#: the largest bucket the engine builds: per-token attention re-reads a chunk's prefix once per token (from L2:
#: one sequence's keys of a layer are a few hundred KB), which grows with the square of the chunk; steps of more
#: tokens run the eager packed step, whose chunk attention tiles the queries
MAX_GRAPH_TOKENS = 1024


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets: every 16 to 128, every 32 to 256, every 64 to 512, then every 128, up to
    ``max_tokens`` (rounded up to a multiple of 16). Multiples of 16 keep Triton's integer
    specialisation (``== 1``, divisible by 16) the same for every step; the spacing bounds padding
    to about a quarter of a step."""
    top = -(-max(16, max_tokens) // 16) * 16
    sizes = list(range(16, 129, 16)) + list(range(160, 257, 32)) + list(range(320, 513, 64))
    sizes += list(range(640, top + 1, 128))
    return sorted({s for s in sizes if s < top} | {top})


class MixedGraphs(BucketGraphs):
    """Packed engine steps of up to ``max_tokens`` tokens over ``cache``, one static step per token bucket.

    Args:
        model: a ``plyx.model.TransformerLM`` (anything taking ``position_ids=``, ``kv_step=``, ``return_hidden=``).
        cache: a block-addressable KV cache (``plyx.attn.supports_static_decode``).
        max_tokens: the most tokens of one step (the largest bucket is this, rounded up to 16).
        max_rows: the most sequences of one step.
        capture: capture CUDA graphs (needs CUDA); False runs the same static step eagerly.
        return_hidden: the model returns final hidden states (the engine applies its LM head to the rows
            that sample) instead of logits.

    ``step`` returns a view of a static output buffer: read it before the next ``step``.
    """

    capture_failure = "CUDA graph capture of a mixed step failed, so mixed steps run their static step eagerly from now on"

    def __init__(self, model: Any, cache: Any, *, max_tokens: int, max_rows: int, capture: bool = True,
                 return_hidden: bool = False, buckets: Sequence[int] | None = None) -> None:
        from plyx.attn import supports_static_decode

        if not supports_static_decode(cache):
            raise TypeError(f"{type(cache).__name__} is not block-addressable; mixed-step graphs need a PagedKVCache")
        device = torch.device(cache.layout.device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. Pass capture=False")
        pack = getattr(model, "pack_projections_", None)
        if pack is not None:  # one GEMM for q/k/v and one for gate/up per layer (same weights, restacked)
            pack()
        self.model = model
        self.cache = cache
        self.capture = capture
        self.return_hidden = return_hidden
        self.buckets = sorted(set(buckets)) if buckets else mixed_buckets(max_tokens)
        if self.buckets[0] < 1:
            raise ValueError(f"buckets {self.buckets} must be >= 1")
        self.max_tokens = n = self.buckets[-1]
        self.max_rows = r = max(1, min(max_rows, n))
        self.block_size = bs = int(cache.block_size)
        self.width = w = -(-cache.layout.max_seq_len // bs)  # block-table columns
        self.device = device
        pinned = device.type == "cuda"
        # int64 [ids | positions | slots | token_row] of n each; int32 [r, w] per-sequence tables
        self._host = torch.zeros(4 * n, dtype=torch.long, pin_memory=pinned)
        self._dev = torch.zeros(4 * n, dtype=torch.long, device=device)
        self._host_tables = torch.zeros(r * w, dtype=torch.int32, pin_memory=pinned)
        self._dev_tables = torch.zeros(r, w, dtype=torch.int32, device=device)
        h = self._host.numpy()
        self._ids, self._pos, self._slots, self._rows = (h[i * n:(i + 1) * n] for i in range(4))
        self._tables = self._host_tables.numpy().reshape(r, w)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self.steps = 0  # steps run here
        self.replays = 0  # steps that replayed a captured graph
        self.warmup_s = 0.0  # seconds ``warm_up`` took

    def bucket(self, tokens: int) -> int | None:
        """The padded token count a step of ``tokens`` runs with (None: more than the largest bucket)."""
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def fits(self, rows: int, tokens: int) -> bool:
        """Whether a step of ``rows`` sequences feeding ``tokens`` tokens in all runs here."""
        return 1 <= rows <= self.max_rows and self.bucket(tokens) is not None

    # -- host side -----------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[int], counts: Sequence[int], tokens: Sequence[int], *,
                bucket: int | None = None) -> int:
        """Reserve ``counts[i]`` tokens for each of ``seq_ids`` and load the step's inputs; the bucket.

        Args:
            seq_ids: one per row (unknown ids are allocated). counts: new tokens per row (>= 1).
            tokens: the ``sum(counts)`` new token ids (host ints), row after row.
            bucket: run with this bucket instead of the smallest that holds the tokens (warm-up).

        Returns:
            The bucket (padded token count) the step runs with.

        The reserve is all or nothing (``CacheFullError`` leaves the cache as it was).
        """
        R, N = len(seq_ids), sum(counts)
        bucket = self.bucket(N) if bucket is None else (bucket if bucket in self.buckets and bucket >= N else None)
        if bucket is None or not 1 <= R <= self.max_rows or len(tokens) != N or min(counts, default=0) < 1:
            raise ValueError(f"a mixed step of {R} rows and {N} tokens (counts {list(counts)[:8]}, {len(tokens)} ids) "
                             f"does not fit: at most {self.max_rows} rows and {self.max_tokens} tokens, every "
                             f"count >= 1 and one id per token")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers may still be in flight to the device
        from plyx.attn import reserve_tokens

        cache = self.cache
        reserve_tokens(cache, seq_ids, counts)
        bs = self.block_size
        pos, slots, rows, tables = self._pos, self._slots, self._rows, self._tables
        self._ids[:N] = tokens
        t = 0
        for i, (sid, n) in enumerate(zip(seq_ids, counts)):
            blocks = cache.seq_blocks(sid)
            end = cache.length(sid)
            used = -(-end // bs)
            tables[i, :used] = blocks[:used]
            if n == 1:  # a decode row: plain ints beat numpy's per-call cost
                p = end - 1
                pos[t] = p
                slots[t] = blocks[p // bs] * bs + p % bs
                rows[t] = i
            else:  # a chunk: its positions and slots as array arithmetic
                p = np.arange(end - n, end)
                pos[t:t + n] = p
                slots[t:t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
                rows[t:t + n] = i
            t += n
        if bucket > N:  # padding tokens repeat token 0: the same writes into the same slot
            for part in (self._ids, pos, slots, rows):
                part[N:bucket] = part[0]
        n = self.max_tokens
        for k in range(4):  # only the used part of each section travels
            self._dev[k * n:k * n + bucket].copy_(self._host[k * n:k * n + bucket], non_blocking=True)
        self._dev_tables.view(-1)[:R * self.width].copy_(self._host_tables[:R * self.width], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return bucket

    # -- device side ---------------------------------------------------------------------
    def _forward(self, bucket: int) -> torch.Tensor:
        """The static step of ``bucket`` tokens, device work only (capturable); ``[bucket, D|V]``."""
        from plyx.attn import KVStep

        n = self.max_tokens
        d = self._dev
        ids = d[:bucket][:, None]  # [bucket, 1]: each token is one row of a one-token step
        positions = d[n:n + bucket][:, None]  # [bucket, 1]
        slots = d[2 * n:2 * n + bucket]
        token_row = d[3 * n:3 * n + bucket]
        tables = self._dev_tables.index_select(0, token_row)  # [bucket, W] int32: each token's sequence's table
        lens = (positions[:, 0] + 1).to(torch.int32)  # [bucket]: a token sees its sequence up to itself
        step = KVStep(cache=self.cache, seq_ids=(), token_index=None, lengths_before=positions[:, 0],
                      lengths_after=(), paged=(tables, lens), key_mask=None, slots=slots)
        out = self.model(ids, position_ids=positions, kv_step=step, return_hidden=self.return_hidden)
        return out[:, -1]  # [bucket, D|V]

    @torch.inference_mode()
    def step(self, seq_ids: Sequence[int], counts: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Feed each sequence its next ``counts[i]`` tokens; every fed token's output ``[N, D|V]`` (a view of a
        static buffer when replayed: read it before the next step). Token ``t`` of the result is the ``t``-th
        fed token, row after row, as in ``plyx.attn.begin_packed_step``."""
        bucket = self.prepare(seq_ids, counts, tokens)
        return self._run(bucket)[:sum(counts)]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run (and, with ``capture``, capture) every bucket once on a scratch sequence, so serving never compiles
        a kernel or captures a graph; returns the seconds it took. Bounded: one eager forward and one capture
        per bucket (``len(buckets)`` of them, largest first so the shared memory pool is sized once). The
        scratch sequence is freed afterwards."""
        start = time.perf_counter()
        cache = self.cache
        for bucket in reversed(self.buckets):
            cache.allocate(_SCRATCH_ID)
            try:  # one real token; the rest of the bucket repeats it
                self.prepare([_SCRATCH_ID], [1], [0], bucket=bucket)
                self._run(bucket)
            finally:
                cache.evict(_SCRATCH_ID)
            self.steps -= 1
            if self.capture is False and self.device.type == "cuda":
                break  # capture failed (warned): the rest would only compile kernels
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._graphs)
