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

Any cache with ``block_size``, ``kv_blocks(layer)`` and ``seq_blocks(seq_id)`` works:
``PagedKVCache`` (its pools) and ``ContiguousKVCache`` (its slab seen as blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from plyx.attn._step import KVStep
from plyx.specs.kvcache import KVCache

__all__ = ["StaticDecode", "supports_static_decode"]

_NEEDS = ("block_size", "kv_blocks", "seq_blocks")


def supports_static_decode(cache: object) -> bool:
    """Whether ``cache`` can be addressed by block (``block_size``, ``kv_blocks``, ``seq_blocks``)."""
    return all(hasattr(cache, name) for name in _NEEDS)


class StaticDecode:
    """Fixed device buffers for one-token steps of up to ``max_batch`` sequences of ``cache``.

    Args:
        cache: a block-addressable KV cache (see ``supports_static_decode``).
        max_batch: the most rows of one step (the largest bucket).

    The tensors ``inputs`` returns are views of the buffers: read them before the next ``prepare``.
    """

    def __init__(self, cache: KVCache, *, max_batch: int) -> None:
        if not supports_static_decode(cache):
            missing = [n for n in _NEEDS if not hasattr(cache, n)]
            raise TypeError(
                f"{type(cache).__name__} cannot run static (graph-captured) decode steps: it lacks "
                f"{', '.join(missing)}; use PagedKVCache or ContiguousKVCache, or turn CUDA graphs off"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        self.cache = cache
        self.max_batch = n = max_batch
        self.block_size = int(cache.block_size)  # type: ignore[attr-defined]
        self.width = -(-cache.layout.max_seq_len // self.block_size)  # block-table columns
        device = torch.device(cache.layout.device)
        self.device = device
        # one int64 buffer: [row_map | positions | slots | lens | tokens] of n each, then the [n, width] tables
        pinned = device.type == "cuda"
        self._host = torch.zeros(5 * n + n * self.width, dtype=torch.long, pin_memory=pinned)
        self._dev = torch.zeros(self._host.shape, dtype=torch.long, device=device)
        h = self._host.numpy()
        self._row_map, self._pos, self._slots, self._lens, self._tokens = (h[i * n:(i + 1) * n] for i in range(5))
        self._tables = h[5 * n:].reshape(n, self.width)
        d = self._dev
        self.row_map, self.positions, self.slots, self.lens, self._dev_tokens = (
            d[i * n:(i + 1) * n] for i in range(5))
        self.tables = d[5 * n:].view(n, self.width)
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)  # each row's input token
        # the kernel reads int32 tables and lengths: converted inside the step (so inside the graph)
        self._tables32 = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self._lens32 = torch.zeros(n, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    def prepare(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[int], bucket: int) -> None:
        """Reserve one token for each of ``seq_ids`` and load the step's inputs for ``bucket`` rows.

        ``tokens`` are the new tokens, one per sequence: a ``[B]`` long tensor on the cache's device
        (sampled there), or host ints (they travel in the same copy as the rest);
        ``bucket`` (>= B, <= max_batch) is the padded batch the step runs with.
        """
        B = len(seq_ids)
        if not 1 <= B <= bucket <= self.max_batch:
            raise ValueError(f"need 1 <= batch ({B}) <= bucket ({bucket}) <= max_batch ({self.max_batch})")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer may still be in flight to the device
        cache = self.cache
        cache.reserve(seq_ids, [1] * B)
        bs = self.block_size
        for i, sid in enumerate(seq_ids):
            blocks = cache.seq_blocks(sid)  # type: ignore[attr-defined]
            length = cache.length(sid)
            pos = length - 1
            self._row_map[i] = i
            self._pos[i] = pos
            self._slots[i] = blocks[pos // bs] * bs + pos % bs
            self._lens[i] = length
            self._tables[i, :len(blocks)] = blocks
        on_host = not isinstance(tokens, torch.Tensor)
        if on_host:
            self._tokens[:B] = tokens
        if bucket > B:  # padding rows repeat row 0
            for part in (self._pos, self._slots, self._lens):
                part[B:bucket] = part[0]
            self._row_map[B:bucket] = 0
            self._tables[B:bucket] = self._tables[0]
        n = self.max_batch
        self._dev[:5 * n].copy_(self._host[:5 * n], non_blocking=True)
        tables = slice(5 * n, 5 * n + bucket * self.width)
        self._dev[tables].copy_(self._host[tables], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        source = self._dev_tokens[:B] if on_host else tokens.reshape(-1)  # type: ignore[union-attr]
        self.tokens[:B].copy_(source, non_blocking=True)

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, KVStep]:
        """``(ids [bucket, 1], positions [bucket, 1], step)`` for the model; device work only (capturable)."""
        ids = self.tokens.index_select(0, self.row_map[:bucket])[:, None]
        self._tables32[:bucket].copy_(self.tables[:bucket])
        self._lens32[:bucket].copy_(self.lens[:bucket])
        step = KVStep(
            cache=self.cache,
            seq_ids=(),
            token_index=None,
            lengths_before=self.positions[:bucket],
            lengths_after=(),
            paged=(self._tables32[:bucket], self._lens32[:bucket]),
            key_mask=None,
            slots=self.slots[:bucket],
        )
        return ids, self.positions[:bucket, None], step
