"""``DecodeGraphs``: the one-token decode step as replayed CUDA graphs, one per batch-size bucket.

At batch 1 a ~1B model's step is ~200 kernel launches and as many Python dispatches;
on a GPU that host work, not the weights' memory traffic, sets the speed. Captured once
per bucket, a step becomes: reserve slots and fill one pinned buffer on the host, one
copy, one ``graph.replay()`` (vLLM's and SGLang's approach). The inputs live at fixed
addresses (``plyx.attn.StaticDecode``); batches are padded up to the next bucket.

A bucket is captured the first time a batch of its size runs: that step first runs
eagerly on a side stream (its result is the step's result, and the Triton kernels are
compiled and warm), then the same call is captured; later steps replay. All graphs
share one memory pool: they run one at a time on one stream.

Without CUDA (``capture=False``) the same static step runs eagerly: the path the CPU
tests check against the ordinary forward.
"""

from __future__ import annotations

import abc
import bisect
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["BucketGraphs", "DecodeGraphs", "capture_step", "chunk_limit", "default_buckets"]

#: the scratch sequence id ``warm_up`` captures on (engine ids count up from 0; MixedGraphs uses -(1 << 40))
_SCRATCH_ID = -(1 << 40) - 1


#: a prompt needing more chunk replays than this is fed by one eager forward instead
MAX_PREFILL_CHUNKS = 12


def chunk_limit(model: Any) -> int:
    """The most prompt tokens per row of one static step: ``plyx.attn.STATIC_MAX_QUERY`` (the step buffers'
    width; the paged kernel tiles any number of query rows), 1 for a model without the attention shape."""
    from plyx.attn import STATIC_MAX_QUERY

    config = getattr(model, "config", None)
    if not getattr(config, "n_heads", None) or not getattr(config, "kv_heads", None):
        return 1
    return STATIC_MAX_QUERY


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32 (vLLM's spacing), ending at ``max_batch``."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 1, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def capture_step(run: Any, pool: Any, failure: str) -> tuple[Any, tuple[Any, Any] | None]:
    """``(result, (graph, out))``: ``run()`` once eagerly on a side stream (torch's rule for capture; its real
    result, kernels compiled), then captured into a graph in ``pool``. Capturing records the kernels without
    running them, so a step that writes the cache does not write it twice. If the capture fails (a kernel that
    syncs with the host, such as a reference fallback), warns ``failure: <the error>`` and returns
    ``(result, None)``: the caller runs that step eagerly from then on."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = run()
    torch.cuda.current_stream().wait_stream(side)
    for t in result if isinstance(result, tuple) else (result,):
        t.record_stream(torch.cuda.current_stream())  # allocated on the side stream, read on this one
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    except RuntimeError as exc:
        torch.cuda.synchronize()
        warnings.warn(f"{failure}: {str(exc).splitlines()[0]}{_raised_at(exc)}", RuntimeWarning, stacklevel=4)
        return result, None
    return result, (graph, out)


def _raised_at(exc: BaseException) -> str:
    """`` (at file:line in function)`` of the innermost plyx frame ``exc`` passed through: which of the step's
    operations cannot be captured (a host copy, a sync), so the warning names the line to fix."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "plyx" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {'/'.join(f.filename.split('/')[-3:])}:{f.lineno} in {f.name})"


class BucketGraphs(abc.ABC):
    """One CUDA graph per bucket of a static step: ``_run(bucket)`` replays the bucket's graph, captures it the
    first time the bucket runs, or runs the static step eagerly (``capture`` False: CPU, or after a failed
    capture, which warns once with ``capture_failure``). Subclasses define ``_forward(bucket)`` (device work
    only) and set ``capture``, ``_graphs`` ({bucket: (graph, out)}), ``_pool`` (None), ``steps`` and ``replays``
    (0); mixed steps (``MixedGraphs``) and verification steps (``SpecGraphs``) share it."""

    capture_failure = "CUDA graph capture of a static step failed, so it runs eagerly from now on"
    capture: bool
    steps: int
    replays: int
    _graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]
    _pool: Any

    @abc.abstractmethod
    def _forward(self, bucket: int) -> torch.Tensor:
        """The static step of ``bucket`` (device work only: capturable)."""

    def _run(self, bucket: int) -> torch.Tensor:
        self.steps += 1
        if not self.capture:
            return self._forward(bucket)
        entry = self._graphs.get(bucket)
        if entry is None:
            return self._capture(bucket)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, bucket: int) -> torch.Tensor:
        """Run ``bucket``'s step eagerly (its real result; kernels compiled), then capture it."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        result, entry = capture_step(lambda: self._forward(bucket), self._pool, self.capture_failure)
        if entry is None:
            self.capture = False
        else:
            self._graphs[bucket] = entry
        return result  # type: ignore[no-any-return]


class DecodeGraphs:
    """Runs one-token decode steps of ``model`` over ``cache`` through captured CUDA graphs.

    Args:
        model: a ``plyx.model.TransformerLM`` (anything taking ``position_ids=`` and ``kv_step=``).
        cache: a block-addressable KV cache (``plyx.attn.supports_static_decode``).
        max_batch: the most sequences of one step (the largest bucket).
        capture: capture graphs (needs CUDA); False runs the static step eagerly.

    ``step`` returns a view of a static output buffer: use it before the next ``step``.
    """

    def __init__(self, model: Any, cache: Any, *, max_batch: int, capture: bool = True,
                 buckets: Sequence[int] | None = None, max_query: int | None = None) -> None:
        from plyx.attn import StaticDecode

        device = torch.device(cache.layout.device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. Pass cuda_graphs=False")
        self.model = model
        pack = getattr(model, "pack_projections_", None)
        if pack is not None:  # one GEMV for q/k/v and one for gate/up per layer: same weights, restacked in place
            pack()
        self.capture = capture
        self.max_query = chunk_limit(model) if max_query is None else max_query
        self.decode = StaticDecode(cache, max_batch=max_batch, max_query=self.max_query)
        self.buckets = sorted(set(buckets)) if buckets else default_buckets(max_batch)
        if self.buckets[-1] > max_batch or self.buckets[0] < 1:
            raise ValueError(f"buckets {self.buckets} must lie in [1, max_batch={max_batch}]")
        self.max_batch = self.buckets[-1]
        # (bucket, tokens per row, greedy output, one-token steps per replay, sampled) -> (graph, its output)
        self._graphs: dict[tuple[int, int, bool, int, bool], tuple[torch.cuda.CUDAGraph, Any]] = {}
        # sampled multi-step blocks read their rows' parameters and uniforms here (``sample_steps``): float64
        # [max_batch, PARAM_WIDTH + max_query], filled by one copy per block from a pinned host twin
        self._sampling: torch.Tensor | None = None
        self._sampling_host: list[torch.Tensor] | None = None
        self._copied: list[Any] = []
        self._turn = 0
        self._seen: tuple[torch.Tensor, torch.Tensor] | None = None  # penalties' [max_batch, V] mask and counts
        self.sampling = True  # sample_steps may run (False after its capture failed: the engine steps instead)
        self._pool: Any = None
        self.steps = 0  # every step run here
        self.replays = 0  # the steps that replayed a captured graph

    def bucket(self, batch: int) -> int | None:
        """The padded size a batch of ``batch`` rows runs with (None: larger than every bucket)."""
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def _bucket_of(self, batch: int) -> int:
        """``bucket(batch)``, or a ValueError naming the largest bucket."""
        bucket = self.bucket(batch)
        if bucket is None:
            raise ValueError(f"a decode step of {batch} sequences exceeds the largest graph bucket ({self.max_batch})")
        return bucket

    def chunks(self, batch: int, length: int) -> list[int] | None:
        """How ``prefill`` feeds ``batch`` prompts of ``length`` tokens each: chunk sizes, or None (not worth it).

        Whole chunks of ``max_query`` tokens, then the remainder in powers of two, so a few graphs per
        bucket (one per chunk size) serve every prompt length. Beyond ``MAX_PREFILL_CHUNKS`` replays an
        eager forward is cheaper: its launch cost no longer dominates a long prompt.
        """
        if self.max_query < 2 or self.bucket(batch) is None or length < 2:
            return None
        sizes = [self.max_query] * (length // self.max_query)
        rest = length % self.max_query
        sizes += [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]
        return sizes if len(sizes) <= MAX_PREFILL_CHUNKS else None

    def prefill(self, seq_ids: Sequence[int], rows: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Feed each sequence its prompt (all of one length) through replayed chunk graphs; last logits ``[B, V]``.

        None (nothing fed) when the rows differ in length or ``chunks`` says an eager forward is better.
        The result is a view of a graph's output buffer: read it before the next step.
        """
        length = len(rows[0]) if rows else 0
        sizes = self.chunks(len(rows), length) if all(len(r) == length for r in rows) else None
        if sizes is None:
            return None
        cache = self.decode.cache
        live = set(cache.sequences())
        new = [s for s in seq_ids if s not in live]
        before = {s: cache.length(s) for s in seq_ids if s in live}
        for s in new:
            cache.allocate(s)
        start, logits = 0, None
        try:
            for size in sizes:
                chunk = [list(r[start:start + size]) for r in rows]
                logits = self.step(seq_ids, chunk if size > 1 else [c[0] for c in chunk], query_len=size)
                start += size
        except BaseException:  # all or nothing, as an eager forward's reserve: leave the cache as it was
            for s in new:
                cache.evict(s)
            for s, length in before.items():
                cache.crop(s, length)
            raise
        return logits

    @torch.inference_mode()
    def step(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[Any], *, greedy: bool = False,
             query_len: int = 1) -> Any:
        """Feed each sequence its new token (``[B]`` on device, or host ints); logits ``[B, V]`` (float32).

        ``greedy`` also returns each row's argmax token ``[B]``, computed inside the graph by the same
        fused kernel as the greedy sampler: plain greedy decoding then launches nothing from Python
        between two replays. ``query_len > 1`` feeds ``B`` host rows of that many tokens (a prompt
        chunk, see ``prefill``) and returns the logits of each row's last one.
        """
        B = len(seq_ids)
        bucket = self._bucket_of(B)
        self.decode.prepare(seq_ids, tokens, bucket, query_len=query_len)
        out = self._run((bucket, query_len, greedy, 1, False))
        return (out[0][:B], out[1][:B]) if greedy else out[:B]

    @torch.inference_mode()
    def greedy_steps(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[int], steps: int) -> torch.Tensor:
        """``steps`` greedy one-token steps in one replay: ``tokens`` (``[B]``) are fed first, then each step's
        argmax; returns the ``steps`` chosen tokens of every row, ``[B, steps]`` (a view: read before the next step).

        The per-step host work (reserving, filling and copying the inputs, launching, reading the tokens
        back) is paid once per ``steps`` tokens. A caller that stops a row early (EOS) crops or evicts it:
        its cache holds all ``steps`` tokens.
        """
        B = len(seq_ids)
        bucket = self._bucket_of(B)
        if not 1 <= steps <= self.max_query:
            raise ValueError(f"steps must be in [1, {self.max_query}] (the step buffers' width), got {steps}")
        self.decode.prepare(seq_ids, tokens, bucket, steps=steps)
        return self._run((bucket, 1, True, steps, False))[:B]  # type: ignore[no-any-return]

    @torch.inference_mode()
    def sample_steps(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[int], steps: int,
                     params: Any, uniforms: Any, seen: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> torch.Tensor:
        """``steps`` sampled one-token steps in one replay, with the block's stop checks: ``tokens`` (``[B]``)
        are fed first, then each step's token, chosen inside the graph by ``engine._sampling.sample_rows_tensor``
        (temperature, top-k, top-p, min-p, ``min_tokens``; greedy rows the argmax).

        Args:
            seq_ids: the rows. tokens: their first inputs.
            steps: tokens per row, in ``[1, max_query]``.
            params: ``[B, PARAM_WIDTH]`` float64 host array (``RowParams.pack``).
            uniforms: ``[B, steps]`` float64 host array, each token's uniform (``row_uniforms``).
            seen: the penalties' prompt masks ``[B, V]`` bool and output counts ``[B, V]`` int32 on the device
                (``seen_state``), or None (no row penalised). Each step adds its tokens to the graph's copy.

        Returns:
            ``[B, steps + 1]`` int64 (a view: read before the next step): the chosen tokens, then how many of them
            the row keeps (``block_count``: up to its first stop id or its length limit). The cache holds all
            ``steps`` tokens of every row: the caller crops or frees a row that finished early.
        """
        B = len(seq_ids)
        bucket = self._bucket_of(B)
        if not 1 <= steps <= self.max_query:
            raise ValueError(f"steps must be in [1, {self.max_query}] (the step buffers' width), got {steps}")
        self._load_sampling(params, uniforms, B, bucket, steps)
        self._load_seen(seen, B, bucket)
        self.decode.prepare(seq_ids, tokens, bucket, steps=steps)
        return self._run((bucket, 1, False, steps, True))[:B]  # type: ignore[no-any-return]

    def _load_sampling(self, params: Any, uniforms: Any, B: int, bucket: int, steps: int) -> None:
        """Write the block's parameters (padded rows neutral) into the persistent buffer the graph reads: one
        non-blocking copy from a pinned host buffer. Two host buffers take turns (with the look-ahead the next
        block is filled while the last one's copy may still wait in the stream); an event per buffer says when
        its copy ran."""
        from plyx.serve.engine._sampling import PARAM_WIDTH, RowParams

        width = PARAM_WIDTH + self.max_query
        device = torch.device(self.decode.cache.layout.device)
        if self._sampling is None:
            self._sampling = torch.zeros(self.max_batch, width, dtype=torch.float64, device=device)
            pinned = device.type == "cuda"
            self._sampling_host = [torch.zeros(self.max_batch, width, dtype=torch.float64, pin_memory=pinned)
                                   for _ in range(2)]
            self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
            self._turn = 0
        self._turn ^= 1
        host, copied = self._sampling_host[self._turn], self._copied[self._turn]  # type: ignore[index]
        if copied is not None:
            copied.synchronize()  # (returns at once unless the device is two blocks behind)
        view = host.numpy()
        view[:B, :PARAM_WIDTH] = params
        view[:B, PARAM_WIDTH:PARAM_WIDTH + steps] = uniforms
        view[B:bucket, :PARAM_WIDTH] = RowParams.padding()
        view[B:bucket, PARAM_WIDTH:] = 0.5
        self._sampling[:bucket].copy_(host[:bucket], non_blocking=True)
        if copied is not None:
            copied.record()

    def _seen_buffers(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent prompt masks and output counts the sampled graphs read, ``[max_batch, vocab]`` each."""
        if self._seen is None:
            device = torch.device(self.decode.cache.layout.device)
            self._seen = (torch.zeros(self.max_batch, vocab, dtype=torch.bool, device=device),
                          torch.zeros(self.max_batch, vocab, dtype=torch.int32, device=device))
        return self._seen

    def _load_seen(self, seen: tuple[torch.Tensor, torch.Tensor] | None, B: int, bucket: int) -> None:
        """The block's penalty state into the persistent buffers (device copies); zeros where none (the graph's
        steps add their tokens to the counts, so the buffers are written every block)."""
        if seen is None and self._seen is None:
            return  # allocated (zeros) by the first sampled forward
        mask, counts = self._seen_buffers(seen[0].shape[1] if seen is not None else 0)
        start = 0
        if seen is not None:
            mask[:B].copy_(seen[0])
            counts[:B].copy_(seen[1])
            start = B
        mask[start:bucket].zero_()
        counts[start:bucket].zero_()

    def _run(self, key: tuple[int, int, bool, int, bool]) -> Any:
        """Replay ``key``'s graph (captured on first use), or run it eagerly without capture."""
        self.steps += key[3]
        if not self.capture:
            return self._forward(*key)
        if (entry := self._graphs.get(key)) is None:
            return self._capture(key)
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _forward(self, bucket: int, query_len: int, greedy: bool, steps: int = 1, sampled: bool = False) -> Any:
        if sampled:
            return self._forward_sampled(bucket, steps)
        if steps > 1:
            return self._forward_steps(bucket, steps)
        from plyx.serve._runner import last_logits

        ids, positions, step = self.decode.inputs(bucket, query_len)
        if query_len > 1:  # a prompt chunk: only the last position's logits, one LM-head row per sequence
            logits = last_logits(self.model, ids, position_ids=positions, kv_step=step)  # [bucket, V]
        else:
            logits = self.model(ids, position_ids=positions, kv_step=step)[:, -1]  # [bucket, V]
        if not greedy:
            return logits
        from plyx.serve._processors import GreedySampler

        return logits, GreedySampler()(logits, None)  # type: ignore[arg-type]  # greedy reads no state

    def _forward_steps(self, bucket: int, steps: int) -> torch.Tensor:
        """``steps`` greedy steps, each fed the previous one's argmax on the device; ``[bucket, steps]`` tokens."""
        from plyx.serve._processors import GreedySampler

        ids, per_step = self.decode.inputs_steps(bucket, steps)
        chosen = []
        for positions, step in per_step:
            logits = self.model(ids, position_ids=positions, kv_step=step)[:, -1]  # [bucket, V]
            token = GreedySampler()(logits, None)  # type: ignore[arg-type]  # greedy reads no state
            chosen.append(token)
            ids = token[:, None]
        return torch.stack(chosen, dim=1)

    def _forward_sampled(self, bucket: int, steps: int) -> torch.Tensor:
        """``steps`` sampled steps from the persistent parameters; ``[bucket, steps + 1]`` tokens and kept counts."""
        from plyx.serve.engine._sampling import PARAM_WIDTH, RowParams, block_count, sample_rows_tensor

        assert self._sampling is not None
        rp = RowParams(self._sampling[:bucket, :PARAM_WIDTH])
        uniforms = self._sampling[:bucket, PARAM_WIDTH:]  # [bucket, max_query]
        ids, per_step = self.decode.inputs_steps(bucket, steps)
        chosen = []
        for j, (positions, step) in enumerate(per_step):
            logits = self.model(ids, position_ids=positions, kv_step=step)[:, -1]  # [bucket, V]
            mask, counts = self._seen_buffers(logits.shape[1])  # (allocated by the eager run before a capture)
            seen = (mask[:bucket], counts[:bucket])
            token = sample_rows_tensor(logits, rp, rp.generated + j, uniforms[:, j], seen=seen)  # [bucket]
            seen[1].scatter_add_(1, token[:, None], torch.ones_like(token[:, None], dtype=torch.int32))
            chosen.append(token)
            # padding rows share row 0's cache slots (``StaticDecode.prepare``): they are fed row 0's token, so
            # they write its keys and values again, never their own (a greedy padding row would pick another)
            ids = token.index_select(0, self.decode.row_map[:bucket])[:, None]  # [bucket, 1]
        tokens = torch.stack(chosen, dim=1)  # [bucket, steps]
        return torch.cat([tokens, block_count(tokens, rp)[:, None]], dim=1)  # [bucket, steps + 1]

    def _capture(self, key: tuple[int, int, bool, int, bool]) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        sampled = key[4]
        result, entry = capture_step(
            lambda: self._forward(*key), self._pool,
            "CUDA graph capture of the sampled multi-step decode failed, so sampled blocks run k one-token steps "
            "from now on (greedy blocks and one-token steps keep their graphs)" if sampled else
            "CUDA graph capture of the decode step failed, so decode steps run eagerly from now on (a kernel the "
            "registry chose syncs with the host; `plyx kernels explain paged_attention` shows which)")
        if entry is None and sampled:
            self.sampling = False  # the forward alone captured before: only the sampling's kernels failed
        elif entry is None:
            self.capture = False
        else:
            self._graphs[key] = entry
        return result

    @torch.inference_mode()
    def warm_up(self, block_steps: Sequence[int] = ()) -> float:
        """Capture, for every bucket, the one-step graphs (logits; logits + greedy token) and the greedy and
        sampled multi-step graphs of ``block_steps`` (the engine's block lengths), so serving never captures mid-run;
        returns the seconds it took. Captured lazily, a batch that grows through new buckets paid a capture
        per bucket and block length on its way: one mixed step of an H100 serving run waited 4.7 s for them.
        Runs on a scratch sequence (freed afterwards), largest bucket first (the memory pool is sized once).
        """
        start = time.perf_counter()
        from plyx.serve.engine._sampling import RowParams

        lengths = [k for k in sorted(set(block_steps)) if 1 < k <= self.max_query]
        keys = [(1, False, False), (1, True, False)] + [(k, True, False) for k in lengths] + \
            [(k, False, True) for k in lengths]
        cache = self.decode.cache
        for bucket in reversed(self.buckets):
            for steps, greedy, sampled in keys:
                if (bucket, 1, greedy, steps, sampled) in self._graphs or (sampled and not self.sampling):
                    continue
                cache.allocate(_SCRATCH_ID)
                try:
                    if sampled:
                        self._load_sampling(RowParams.padding()[None], [[0.5] * steps], 1, bucket, steps)
                    self.decode.prepare([_SCRATCH_ID], [0], bucket, steps=steps)
                    self._run((bucket, 1, greedy, steps, sampled))
                finally:
                    cache.evict(_SCRATCH_ID)
                self.steps -= steps
                if not self.capture:
                    break  # capture failed (warned): the rest would only compile kernels
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far (with or without the greedy token output)."""
        return sorted({key[0] for key in self._graphs})
