"""Multi-step decode: ``k`` decode steps per schedule, the host reading the tokens once per block.

A decode-only step's device work is small (one token per row); what it costs on a GPU is the host work
around it: scheduling, reserving slots, filling and copying the step's inputs, reading the tokens back,
accepting them. When nothing can change the batch in between (no request waits, no row needs per-token
host logic) the engine runs ``k`` steps back to back, each fed the previous step's tokens on the device:

* plain-greedy batches on CUDA: one replay of ``DecodeGraphs.greedy_steps`` (the ``k`` steps and their
  argmax inside one CUDA graph, as ``generate`` decodes);
* batches of tensor rows (``engine._sampling.tensor_row``: temperature, top-k, top-p, min-p, ``min_tokens``,
  greedy, seeds) on CUDA: one replay of ``DecodeGraphs.sample_steps``, the ``k`` forwards, each row's
  processing and draw (its Philox uniforms computed on the host, as the rows' parameters, and copied once per
  block) and the block's stop checks inside one graph;
* anything else (logit bias, bans, typical-p; CPU; no graph bucket): ``k`` one-token forwards (graph replays
  where a bucket holds the batch) and ``k`` device-side samplings (``RowSampler``: the same tensor processing
  for tensor rows, the ``LogitsPipeline`` for the others, the same uniforms).

Every block yields one ``[B, k + 1]`` tensor read by one device-to-host copy: the tokens, and how many of them
each row keeps by the stop checks run on the device (``block_count``: EOS and stop ids, ``max_tokens``). Each
row's kept tokens are accepted in order, the host still checking each (stop strings, which need the text, end
a row there), so a row keeps exactly what a one-step engine would have emitted and its later tokens are
discarded with its cache entry. They stream one event per token, or with ``EngineConfig.stream_interval = s``
in events of up to ``s`` tokens (one ``Completion.add`` and one text delta each): the block's tokens reach the
host together anyway, and fewer events means less work for the engine and the server's event loop, which share
the GIL with the engine thread. Seeded and greedy rows produce the same tokens as with ``k = 1``: a row's token ``i`` draws the
uniform of (its seed, ``i``) whatever the block, and ``min_tokens`` sees the count it would see.

A block needs ``k`` free slots per row. When the pool is short, blocks the prefix cache alone holds are
evicted first, as many as the rows' real tokens need (what the one-step scheduler would evict on its way to
the same tokens); only then is ``k`` halved. Without that, a full pool (32 rows near the end of 512-token
completions beside the prefix cache's prompt blocks) ran its last ~25 tokens per row one step per schedule.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from plyx.serve.engine._sampling import (
    RowParams,
    RowSampler,
    _needs_state,
    block_count,
    count_tokens,
    plain_greedy,
    seen_state,
    seq_uniforms,
    tensor_row,
)
from plyx.serve.engine._sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from plyx.serve.engine._engine import Engine, EngineOutput

__all__ = ["accept_ahead", "accept_block", "block_steps", "multi_step_row", "run_block"]


def multi_step_row(seq: Sequence) -> bool:
    """Whether a decoding row needs no host logic between two of its tokens: no grammar, log-probs, custom
    processors or samplers, adapter; penalties only on a tensor row (its output counts are updated on the
    device, step by step inside the block). Stop strings are checked on the
    host while the block's tokens are accepted: a row that ends on one inside a block drops the rest of it
    (freed with its cache entry, as a row ending by EOS)."""
    p = seq.params
    return (seq.matcher is None and p.logprobs is None and not p.processors and p.sampler is None
            and (tensor_row(seq) or not _needs_state(seq)) and seq.request.adapter is None
            and len(seq.tokens) > len(seq.request.prompt_ids))  # its first token forks followers (n > 1)


def block_steps(engine: Engine, planned: list[tuple[Sequence, int]]) -> int:
    """How many decode steps this schedule runs: ``EngineConfig.decode_steps`` rounded down to a power of two
    (so a few graphs per bucket serve every block) when the step is decode-only, every running row is in it
    and allows it, nothing waits (or the batch is full: then the block ends where the first row ends by
    length), and the cache has room; else 1.

    The block never runs past the longest remaining completion (a shorter row's extra tokens are discarded)
    nor past the context of any row.
    """
    k = engine.decode_steps
    if k <= 1 or len(planned) != len(engine.running) or not _may_wait(engine):
        return 1
    seqs = []
    for seq, n in planned:
        if n != 1 or seq.pending != 1 or not multi_step_row(seq):
            return 1
        seqs.append(seq)
    left = [s.completion.limit - len(s.completion.token_ids) for s in seqs]
    room = min(engine.max_model_len - len(s.tokens) + 1 for s in seqs)  # cache positions left to the fullest row
    # waiting requests (a full batch): the block ends where the first row ends by length, so they are admitted
    # then; otherwise it runs to the longest remaining completion
    k = min(k, min(left) if engine.waiting else max(left), room)
    if k <= 1:
        return 1
    k = 1 << (k.bit_length() - 1)
    ids = [s.seq_id for s in seqs]
    while k > 1 and not _room(engine, ids, left, k):
        k //= 2  # never preempt (nor evict beyond the rows' real tokens) for a block's speculative tail
    return k


def _room(engine: Engine, ids: list[int], left: list[int], k: int) -> bool:
    """Whether the pool holds ``k`` more slots for each row of ``ids``. When it does not, prefix-cache blocks
    nobody else holds are evicted (LRU) for the slots the rows will really use (``min(k, left)`` each: a
    one-step engine evicts them too on its way to those tokens), never for a row's tail past its end."""
    cache = engine.cache
    need = cache.blocks_needed(ids, [k] * len(ids))
    free = cache.num_free_blocks()
    if need <= free:
        return True
    if engine.prefix is None:
        return False
    real = cache.blocks_needed(ids, [min(k, max(1, n)) for n in left])
    if real > free:
        engine.prefix.evict(real - free)
    return need <= cache.num_free_blocks()


def _may_wait(engine: Engine) -> bool:
    """Whether waiting requests may wait for a block's end: none waits, or the batch is full (nothing could be
    admitted before a running row ends anyway)."""
    return not engine.waiting or len(engine.running) >= engine.config.max_batch_size


def _one_step(engine: Engine, ids: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Feed each row its token (``[B]`` on the device); the next logits ``[B, V]``. Reserves one slot per row."""
    graphs = engine.graphs
    if graphs is not None and graphs.bucket(len(ids)) is not None:
        return graphs.step(ids, tokens)  # type: ignore[no-any-return]  # the graph's buffer: sampled before reuse
    if engine.packed:
        from plyx.attn import begin_packed_step

        ids_t, positions, step = begin_packed_step(engine.cache, ids, [1] * len(ids), tokens, engine.device)
        out = engine.model(ids_t, position_ids=positions, kv_step=step, return_hidden=engine._lm_head)  # [1, B, D|V]
        return engine._logits(out[0])  # [B, V]
    # one forward of [B, 1] through the cache's own writes (quantised caches, no packed step)
    kw: dict[str, Any] = {"cache": engine.cache, "seq_ids": ids, "attention_mask": None}
    out = engine.model(tokens[:, None], return_hidden=engine._lm_head, **kw) if engine._lm_head else \
        engine.model(tokens[:, None], **kw)  # [B, 1, D|V]
    return engine._logits(out[:, -1])  # [B, V]


def _queue_block(engine: Engine, seqs: list[Sequence], first: list[int] | torch.Tensor, k: int,
                 unread: int = 0) -> torch.Tensor:
    """Queue ``k`` decode steps of ``seqs``, fed ``first`` (host ints or ``[B]`` on the device) first; on the device,
    not read: ``[B, k + 1]``, the chosen tokens and how many of them each row keeps (``block_count``: up to its
    first stop id or its length limit), a copy where a graph's output buffer held them. ``unread``: tokens each row
    chose in a block the host has not read yet (the look-ahead's), counted as generated by the sampler
    (``min_tokens``, the rows' random streams) and the stop checks."""
    ids = [s.seq_id for s in seqs]
    graphs = engine.graphs
    params = RowParams.pack(seqs, offset=unread)  # [B, PARAM_WIDTH] on the host
    if graphs is not None and graphs.bucket(len(ids)) is not None and k <= graphs.max_query:
        if all(plain_greedy(s) for s in seqs):
            # one replay; its output buffer is overwritten by the next: cloned (a device copy) for a queued block
            tokens = graphs.greedy_steps(ids, first, k)  # [B, k]
            count_tokens(seqs, tokens)
            return _with_count(tokens, _params_on(params, tokens.device))
        # sampling and stop checks inside one replay (a penalised row whose state was never built, e.g. one whose
        # first token came from a prefill worker, takes one eager block: its sampler builds the state)
        if graphs.sampling and all(tensor_row(s) and (s.prompt_mask is not None or not _needs_state(s)) for s in seqs):
            seen = None
            if any(_needs_state(s) for s in seqs):
                vocab = next(s.prompt_mask.shape[0] for s in seqs if s.prompt_mask is not None)  # type: ignore
                seen = seen_state(seqs, vocab, engine.device)
            out = graphs.sample_steps(ids, first, k, params, _uniforms(seqs, unread, k), seen).clone()
            count_tokens(seqs, out[:, :k])
            return out  # type: ignore[no-any-return]
    tokens = first if isinstance(first, torch.Tensor) else torch.tensor(first, dtype=torch.long, device=engine.device)
    sample: RowSampler | None = None
    chosen = []
    for j in range(k):
        logits = _one_step(engine, ids, tokens)  # [B, V]
        if sample is None:  # built once per block (the logits' width may exceed the tokenizer's vocabulary)
            sample = RowSampler(seqs, logits.shape[1], logits.device, engine.generator)
        tokens = sample(logits, generated_offset=unread + j)  # [B], no host sync
        sample.advance(tokens)  # penalised rows: the next step counts this token
        chosen.append(tokens)
    out = torch.stack(chosen, dim=1)  # [B, k]
    count_tokens(seqs, out)
    return _with_count(out, _params_on(params, out.device))


def _params_on(params: Any, device: torch.device) -> RowParams:
    """``RowParams`` of a packed host array, copied without waiting for the device."""
    index = torch.from_numpy(params)
    return RowParams(index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index.to(device))


def _with_count(tokens: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """``[B, k]`` tokens and the stop checks' kept counts, ``[B, k + 1]`` (one tensor: one read)."""
    return torch.cat([tokens, block_count(tokens, rp)[:, None]], dim=1)


def _uniforms(seqs: list[Sequence], unread: int, k: int) -> Any:
    """Each row's ``k`` uniforms of the block (``[B, k]`` float64 host array): its stream at the block's token
    indices."""
    import numpy as np

    start = np.asarray([len(s.tokens) - len(s.request.prompt_ids) + unread for s in seqs], dtype=np.int64)
    return seq_uniforms(seqs, start, k)


def run_block(engine: Engine, seqs: list[Sequence], k: int) -> list[EngineOutput]:
    """Run ``k`` decode steps of ``seqs`` (each fed its one pending token first) and accept their tokens.

    With the look-ahead on (CUDA), the next block is queued before this one's tokens are read (``_queue_next``):
    the device computes block N + 1 while the host accepts, detokenises and streams block N.
    """
    out = _queue_block(engine, seqs, [s.tokens[s.num_computed] for s in seqs], k)
    _queue_next(engine, seqs, out, k)
    return accept_block(engine, seqs, _to_host(engine, out))  # the block's one device-to-host copy


def _to_host(engine: Engine, tokens: torch.Tensor) -> list[list[int]]:
    """``tokens.tolist()``, waiting for the device with the GIL released (a CUDA event's wait): the server's
    event loop streams the previous block's tokens meanwhile instead of waiting for the engine thread.

    The copy lands in a pinned buffer kept on the engine (one per block shape; a block is read before the next
    one's copy is queued, so one buffer each is enough) and the event is reused: no allocation per block."""
    if tokens.device.type != "cuda":
        return tokens.tolist()  # type: ignore[no-any-return]
    reader = getattr(engine, "_block_reader", None)
    if reader is None:
        reader = engine._block_reader = _HostReader()
    return reader.read(tokens)


class _HostReader:
    """Preallocated pinned host buffers and one CUDA event for reading blocks' tokens back.

    ``wait_s`` sums the seconds the host waited for the device in ``read``: near zero means the device had
    finished before the host asked (the host is the bottleneck), about a block's device time means the device
    is (``bench/serving.py --step-trace`` records it per step)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, ...], torch.Tensor] = {}
        self.done = torch.cuda.Event()
        self.wait_s = 0.0

    def read(self, tokens: torch.Tensor) -> list[list[int]]:
        key = tuple(tokens.shape)
        host = self.buffers.get(key)
        if host is None:
            host = self.buffers[key] = torch.empty(key, dtype=torch.long, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        self.done.record()
        start = time.perf_counter()
        self.done.synchronize()
        self.wait_s += time.perf_counter() - start
        return host.tolist()  # type: ignore[no-any-return]


def _queue_next(engine: Engine, seqs: list[Sequence], out: torch.Tensor, k: int) -> None:
    """Queue the block after ``out`` (``[B, k]``, not read yet) when the next step would run exactly that block:
    the look-ahead is on, nothing waits (or the batch is full), these rows are every running row, and either none
    ends by length inside ``out`` or nothing waits: then the block is queued for the rows that go on (what a fresh
    schedule after reading ``out`` would run, minus the device's idle time while the host reads and schedules).
    With requests waiting for a full batch, a row ending by length frees a slot: the next step schedules afresh.
    A row that ends inside ``out`` by EOS or a stop id wastes its share (its cache entry is freed when it
    finishes; the device writes into those blocks before anything later on its stream)."""
    if not engine.look_ahead or not _may_wait(engine) or len(seqs) != len(engine.running):
        return
    left = [s.completion.limit - len(s.completion.token_ids) - k for s in seqs]  # after this block
    last = out[:, k - 1]  # [B]: each row's next input (column k holds the kept counts)
    if min(left) <= 0:  # a row ends by length inside this block
        if engine.waiting:
            return  # its slot goes to a waiting request: schedule afresh
        keep = [i for i, n in enumerate(left) if n > 0]
        if not keep:
            return
        seqs, left = [seqs[i] for i in keep], [left[i] for i in keep]
        last = last.index_select(0, _device_index(keep, last.device))  # [B']
    room = min(engine.max_model_len - len(s.tokens) - k + 1 for s in seqs)
    k2 = min(engine.decode_steps, min(left) if engine.waiting else max(left), room)
    if k2 <= 1:
        return
    k2 = 1 << (k2.bit_length() - 1)
    ids = [s.seq_id for s in seqs]
    if not _room(engine, ids, left, k2):
        return
    engine._block_ahead = (seqs, _queue_block(engine, seqs, last, k2, unread=k))
    engine.stats.looked_ahead += k2 * len(seqs)


def accept_ahead(engine: Engine) -> list[EngineOutput]:
    """The block the previous step queued: its rows still running take its tokens (finished or aborted rows'
    are discarded), after the block after it is queued where the look-ahead allows."""
    seqs, out = engine._block_ahead  # type: ignore[misc]
    engine._block_ahead = None
    alive = [i for i, s in enumerate(seqs) if s.status is SeqStatus.RUNNING and not s.finished]
    if not alive:
        return []
    if len(alive) != len(seqs):
        out = out.index_select(0, _device_index(alive, out.device))  # [B', k]
        seqs = [seqs[i] for i in alive]
    k = out.shape[1] - 1  # [B', k + 1]: the tokens, then the kept counts
    engine.stats.steps += k
    engine.stats.multi_step_blocks += 1
    _queue_next(engine, seqs, out, k)
    return accept_block(engine, seqs, _to_host(engine, out))


def _device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as a long tensor on ``device`` without waiting for the GPU (a pinned, non-blocking copy): a
    copy from pageable memory would wait for the queued block, and the next block would be queued only then."""
    index = torch.tensor(rows, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def accept_block(engine: Engine, seqs: list[Sequence], rows: list[list[int]]) -> list[EngineOutput]:
    """Accept each row's tokens in order, up to the token that finishes it (its cache entry, holding the block's
    later tokens too, is freed then): one event per ``EngineConfig.stream_interval`` tokens (0: per block).

    ``rows``: per row its ``k`` tokens then the count the device's stop checks keep (``block_count``); the host
    looks at those alone. It still checks each (stop strings end a row earlier; a grammar row never gets here).
    """
    outputs: list[EngineOutput] = []
    interval = engine.config.stream_interval
    k = len(rows[0]) - 1 if rows else 0
    whole = interval == 0 or interval >= max(k, 2)  # each row's block is one event (1: one per token, _accept)
    for seq, packed in zip(seqs, rows):
        kept = packed[-1]
        if whole and kept == k:  # the common case: the device's checks keep the whole block
            seq.num_computed += k  # the tokens fed before these are in the cache (see _accept_row)
            outputs.extend(engine._accept_tokens(seq, packed[:k]))
            continue
        row = packed[:-1]
        every = interval or len(row)  # 0: the row's whole block in one event
        _accept_row(engine, seq, row[:kept], every, outputs)
        if not seq.finished and kept < len(row):  # (the device saw a stop the host did not: take the rest)
            _accept_row(engine, seq, row[kept:], every, outputs)
    return outputs


def _accept_row(engine: Engine, seq: Sequence, row: list[int], every: int, outputs: list[EngineOutput]) -> None:
    if every == 1:
        for token in row:
            seq.num_computed += 1  # the token fed before this one is in the cache
            outputs.extend(engine._accept(seq, token, None))
            if seq.finished:
                return
        return
    for start in range(0, len(row), every):
        part = row[start:start + every]
        # the tokens fed before these are in the cache (a row that finishes inside ``part`` is freed and its
        # count clamped by ``_accept_tokens``)
        seq.num_computed += len(part)
        outputs.extend(engine._accept_tokens(seq, part))
        if seq.finished:
            return
