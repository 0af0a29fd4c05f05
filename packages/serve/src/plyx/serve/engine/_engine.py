"""``Engine``: continuous batching with chunked prefill, preemption by recompute and prefix caching.

Every ``step()``:

1. **schedule** (vLLM v1's token-budget scheduler): each running sequence asks for
   its pending tokens — 1 when decoding, the rest of the prompt (chunked to the
   budget) when prefilling; decodes go first so a long prompt never stalls them.
   Then waiting requests are admitted while the budget, the batch size and the free
   blocks allow, each first forking the longest cached prefix of its prompt.
   When blocks run out: evict unused prefix-cache blocks (LRU), then preempt the
   latest-arrived running sequence (its cache entry is dropped, its tokens are
   kept, it is recomputed when resumed: same tokens, same generator, same output).
2. **execute**: one packed forward over every scheduled token (``plyx.attn.begin_packed_step``:
   prefill chunks and decode rows flattened into one ``[1, N]`` batch, attention through the
   paged kernel per group of equal counts); decode-only steps replay a CUDA graph of their
   batch bucket where one is captured, and steps with prefill chunks a graph of their token-count
   bucket (``MixedGraphs``, captured when the engine starts). Without a block-addressable cache (or with resident
   adapters) one forward per group of equal new-token counts, so no row is padded.
3. **sample** the rows that reached the end of their tokens, each with its own
   processors and seeded generator; completions ``n > 1`` fork completion 0's
   cache once its prompt is computed. The rows of a beam request (``BeamSearchParams``) are not
   sampled: their group takes a beam-search step once all its beams have logits (``_beam_group``).

All state lives on the thread that calls ``step`` (``AsyncEngine`` runs it on its own thread).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Any

import msgspec
import torch
from plyx.serve._completion import Completion
from plyx.serve._outputs import RequestOutput, StreamEvent
from plyx.serve._params import BeamSearchParams, SamplingParams
from plyx.serve._tokenizer import TokenizerView
from plyx.serve.engine._beam_group import BeamGroup, beam_rows_params, check_beam_request, step_beams
from plyx.serve.engine._config import DEFAULT_CUDA_DECODE_STEPS, EngineConfig
from plyx.serve.engine._guard import RequestGuard
from plyx.serve.engine._multistep import accept_ahead, block_steps, multi_step_row, run_block
from plyx.serve.engine._prefix_cache import PrefixCache
from plyx.serve.engine._sampling import admission_seed, sample_rows
from plyx.serve.engine._sequence import EngineRequest, SeqStatus, Sequence
from plyx.specs.errors import ConfigError

__all__ = ["Engine", "EngineOutput", "EngineStats", "QueueFullError"]


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queue`` requests; retry later (the server answers HTTP 429)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        super().__init__(f"the engine queue is full ({max_queue} waiting requests); retry later or raise max_queue")


class EngineOutput:
    """What one step produced for one completion.

    Attributes:
        request_id, index: the request and which of its ``n`` completions.
        event: the new tokens and text (``plyx.serve.StreamEvent``), or None for an aborted completion.
        request_finished: every completion of the request is done (its last output of all).
        aborted: the request was aborted (``Engine.abort``); no further outputs come.
    """

    __slots__ = ("aborted", "event", "index", "request_finished", "request_id")

    def __init__(self, request_id: str, index: int, event: StreamEvent | None, *, request_finished: bool = False,
                 aborted: bool = False) -> None:
        self.request_id = request_id
        self.index = index
        self.event = event
        self.request_finished = request_finished
        self.aborted = aborted


class EngineStats:
    """Counters since the engine started, and gauges of the last step."""

    def __init__(self) -> None:
        self.steps = 0
        self.prompt_tokens = 0  # prompt tokens computed (recomputes included)
        self.generated_tokens = 0
        self.preemptions = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.multi_step_blocks = 0  # schedules that ran several decode steps (``EngineConfig.decode_steps``)
        self.looked_ahead = 0  # tokens fed by a look-ahead forward that the next step sampled from
        self.spec_drafted = 0  # draft tokens fed (speculative_ngram, draft_heads: every tree node)
        self.spec_accepted = 0  # draft tokens the target's argmax confirmed
        self.spec_rows = 0  # row-steps that verified drafts: acceptance length = 1 + spec_accepted / spec_rows
        self.last_batch_tokens = 0
        self.last_batch_seqs = 0


def _model_config(model: Any) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
        raise ConfigError("model", "the model has no plyx ModelConfig at `.config`", value=type(model).__name__,
                          fix="pass a plyx.model.TransformerLM (or load one with plyx.model.load_checkpoint)")
    return cfg


class Engine:
    """The continuous-batching engine over one model and one paged KV cache.

    Args:
        model: a ``plyx.model.TransformerLM`` (any model with its call signature and ``.config``).
        tokenizer: a ``tokenizers.Tokenizer``, a transformers tokenizer or a ``TokenizerView``; needed for
            text, stop strings and structured output (token ids work without one).
        config: scheduler limits and cache geometry.
        eos_token_id: id (or ids) that end completions (default: the tokenizer's EOS).
        seed: seed of the generator of unseeded sampled requests.
        draft_heads: loaded ``plyx.model.MedusaHeads`` (or their directory) to speculate with; overrides
            ``config.draft_heads``.
        cache: an existing ``plyx.attn.PagedKVCache`` to allocate sequences in (``generate(cache=...)``): the
            sequences already in it are left alone (the engine's ids start past them) and no prefix is kept in
            it after a request ends (no prefix caching); None: the engine's own pool (``config``'s geometry).

    Example::

        engine = Engine(model, tokenizer=tok, config=EngineConfig(max_batch_size=16, num_blocks=512))
        outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=8))
    """

    def __init__(self, model: Any, *, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_token_id: int | Seq[int] | None = None, seed: int = 0, lora: Any = None,
                 draft_heads: Any = None, cache: Any = None) -> None:
        from plyx.attn import cache_layout

        self.model = model.eval()
        self.config = config or EngineConfig()
        mcfg = _model_config(model)
        self.vocab_size = int(mcfg.vocab_size)
        self.tokenizer = None if tokenizer is None else (
            tokenizer if isinstance(tokenizer, TokenizerView) else TokenizerView(tokenizer))
        eos = eos_token_id if eos_token_id is not None else (
            self.tokenizer.eos_token_id if self.tokenizer is not None else None)
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (
            (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos))
        param = next(iter(model.parameters()))
        self.device, dtype = param.device, param.dtype
        c = self.config
        self.max_model_len = c.max_model_len or int(mcfg.max_seq_len)
        first_id = 0
        if cache is not None:  # the caller's pool: its geometry, its live sequences kept
            self.cache = cache
            bs = int(cache.block_size)
            self.max_model_len = min(self.max_model_len, int(cache.layout.max_seq_len))
            first_id = 1 + max(cache.sequences(), default=-1)
        else:
            bs = c.block_size
            per_seq = -(-self.max_model_len // bs)
            # the default holds max_batch_size full sequences and the copy-on-write block the check below asks for
            num_blocks = c.num_blocks or c.max_batch_size * per_seq + 1
            if num_blocks < per_seq + 1:
                raise ConfigError("EngineConfig.num_blocks",
                                  f"the pool must hold one sequence of max_model_len={self.max_model_len} tokens "
                                  f"({per_seq} blocks of {bs}) plus one copy-on-write block", value=num_blocks,
                                  fix=f"pass num_blocks >= {per_seq + 1} or lower max_model_len")
            layout = cache_layout(mcfg, max_seq_len=self.max_model_len, block_size=bs, num_blocks=num_blocks,
                                  device=str(self.device), dtype=dtype)
            self.cache = c.paged_cache(layout)  # PagedKVCache, or QuantizedPagedKVCache (kv_cache_dtype)
        self.prefix: PrefixCache | None = (PrefixCache(self.cache, bs) if c.prefix_caching and cache is None
                                           else None)
        self.requests: dict[str, EngineRequest] = {}
        self.beam_groups: dict[str, BeamGroup] = {}  # request id -> the search of a running beam request
        self.waiting: list[Sequence] = []  # sorted by priority (arrival order)
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seq_ids = itertools.count(first_id)
        self._guards: dict[str, EngineRequest] = {}  # request id -> a guarded request (until it ends)
        self.client_busy = False  # a generate() call is draining this engine (it is kept for the next call)
        self._order = itertools.count()
        self._priority: dict[int, tuple[int, int]] = {}  # seq_id -> (request order, index)
        self._grammar_cache: dict[str, Any] = {}
        self._lm_head = getattr(model, "lm_head_weight", None) is not None
        # resident adapters (``plyx.serve.MultiLora``): requests name one; a step's rows may mix them
        self.lora = lora
        steps = c.decode_steps if c.decode_steps is not None else (DEFAULT_CUDA_DECODE_STEPS if self.device.type == "cuda" else 1)
        # multi-step decode (``_multistep``): plain rows only; drafts and adapters keep one step per schedule (a
        # speculating engine under spec_policy 'auto' runs blocks on the steps its rule leaves plain)
        heads = draft_heads if draft_heads is not None else (c.draft_heads or None)
        speculating = bool(c.speculative_ngram) or heads is not None
        self.decode_steps = 1 if lora is not None or (speculating and c.spec_policy == "always") else steps
        self._spec_step = False  # this step's schedule may attach drafts (the policy said speculate)
        self.graphs = self._decode_graphs() if lora is None else None  # graphs bake in one adapter map
        # one packed (varlen) forward per step: every scheduled token in one [1, N] row
        self.packed = self._can_pack()
        # packed steps as graphs, one per token-count bucket, warmed (compiled and captured) here, not mid-serving
        self.mixed_graphs = self._mixed_step_graphs()
        # decode steps replayed as graphs must hold decodes alone, and a packed step needs no padded ride-along
        self._mixed = 0 if self.graphs is not None or self.packed else c.mixed_chunk
        # look-ahead: the next token's logits of sequences whose last sampled token was fed before the host read it
        # prompt-lookup speculation: drafts ride in the packed forward as the row's extra tokens
        # or Medusa draft heads (``_draft_proposer``): chain or token-tree drafts from the last hidden states
        self.proposer = self._draft_proposer(heads)
        self.spec_k = (self.proposer.k if self.proposer is not None else c.speculative_ngram) if self.packed else 0
        self._drafts: dict[int, list[int]] = {}  # seq_id -> this step's draft tokens
        # greedy verification (and the heads' next proposal) as one static step per rows bucket, captured on CUDA;
        # and the per-step rule that turns speculation off where it measures slower than plain decoding
        from plyx.serve.engine._spec_graphs import SpecPolicy, build

        self.spec_graphs = build(self)
        self.spec_policy = SpecPolicy(c.spec_policy) if self.spec_k else None
        self._draft_parents: dict[int, list[int]] = {}  # seq_id -> a tree row's parents (fed indices; chains absent)
        ahead = self.device.type == "cuda" if c.look_ahead is None else c.look_ahead
        self.look_ahead = ahead and (self.packed or self.graphs is not None) and not self.spec_k
        self._ahead: dict[int, torch.Tensor] = {}  # seq_id -> logits [V] (that token counts as computed)
        # a multi-step block queued before the host read the previous one: (its rows, its tokens [B, k] on the device)
        self._block_ahead: tuple[list[Sequence], torch.Tensor] | None = None

    def _can_pack(self) -> bool:
        """Whether steps run as one packed forward: asked for, a block-addressable cache, a model with the
        prepared-step entry point (``kv_step``), and no resident adapters (they select weights per batch row).
        A quantised cache (``kv_scales``: int8/fp8 pools) packs too: its writes quantise (``rope_store_kv_quant``
        / ``write_slots``) and its groups attend through ``paged_attention_quant``; the per-group path would run
        each step's decodes apart from the prefill chunks and dequantise every prefilling sequence whole per layer."""
        import inspect

        from plyx.attn import supports_static_decode

        if not self.config.packed_step or self.lora is not None or not supports_static_decode(self.cache):
            return False
        return "kv_step" in inspect.signature(self.model.forward).parameters

    def _mixed_step_graphs(self) -> Any:
        """``MixedGraphs`` for packed steps (see ``EngineConfig.mixed_graphs``), warmed up on CUDA; or None."""
        c = self.config
        want = c.mixed_graphs
        if want is None:
            want = c.cuda_graphs and self.device.type == "cuda"
        if not want or not self.packed:
            return None
        from plyx.serve.engine._mixed_graphs import MAX_GRAPH_TOKENS, MixedGraphs

        graphs = MixedGraphs(self.model, self.cache, max_tokens=min(c.max_batch_tokens, MAX_GRAPH_TOKENS),
                             max_rows=c.max_batch_size, capture=self.device.type == "cuda",
                             return_hidden=self._lm_head)
        if self.device.type == "cuda":
            graphs.warm_up()
        return graphs

    def _decode_graphs(self) -> Any:
        """CUDA-graph decode steps (``DecodeGraphs``) when the config asks and the model and device allow."""
        import inspect

        if not self.config.cuda_graphs or self.device.type != "cuda":
            return None
        if "kv_step" not in inspect.signature(self.model.forward).parameters:
            return None  # a model without the static-step entry point runs eagerly
        from plyx.serve._graphs import DecodeGraphs

        # the engine's prefill chunks run as ordinary forwards (ragged, mixed with decodes), so the step buffers
        # (copied to the device every step) are one token wide, or decode_steps wide: a multi-step block of k
        # greedy steps (``greedy_steps``) takes k columns
        graphs = DecodeGraphs(self.model, self.cache, max_batch=self.config.max_batch_size,
                              max_query=max(1, self.decode_steps))
        if self.decode_steps > 1:  # multi-step blocks: every (bucket, block length) captured now, not mid-serving
            graphs.warm_up([1 << i for i in range(1, self.decode_steps.bit_length())])
        return graphs

    # -- requests --------------------------------------------------------------------------
    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled xgrammar grammar of ``params.structured`` (cached per constraint), or None.

        Compiling can take tens of milliseconds: servers call this off the engine thread.
        """
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise ConfigError("SamplingParams.structured", "structured output needs a tokenizer", value=None,
                              fix="build the Engine with tokenizer=...")
        import msgspec
        from plyx.serve._structured import compile_structured

        stops = self._stop_ids(params)
        key = msgspec.json.encode(params.structured).decode() + repr(stops)
        if key not in self._grammar_cache:
            self._grammar_cache[key] = compile_structured(params.structured, self.tokenizer, self.vocab_size, stops)
        return self._grammar_cache[key]

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = () if params.ignore_eos else self.eos_token_ids
        return sorted(set(ids) | set(params.stop_token_ids))

    def check_prompt(self, prompt_ids: Seq[int], where: str = "prompt") -> None:
        """Raise ``ConfigError`` for an empty prompt, a prompt over the context or an id outside the vocabulary."""
        if len(prompt_ids) == 0:
            raise ConfigError(where, "the prompt is empty", value="", fix="send at least one token")
        if len(prompt_ids) > self.max_model_len:
            raise ConfigError(where, f"the prompt has {len(prompt_ids)} tokens, more than the model's context "
                              f"of {self.max_model_len}", value=len(prompt_ids),
                              fix="shorten the prompt")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ConfigError(where, f"token ids must be in [0, {self.vocab_size})", value=bad[:8],
                              fix="encode the prompt with the model's tokenizer")

    def admit(self, guard: RequestGuard) -> None:
        """Run ``guard``'s input rails (once per guard; thread-safe: it touches no engine state). A server calls
        this before it tokenizes a rewritten prompt; ``add_request`` calls it for a guard nobody admitted.

        Raises:
            RequestRefused: an input rail refused the request (already reported through ``plyx_on_response``).
        """
        guard.admit()

    def guard_for(self, request_id: str, prompt_ids: Seq[int], prompt_text: str | None = None,
                  endpoint: str = "engine") -> RequestGuard:
        """The ``RequestGuard`` of a request queued without one: the hooks see ``prompt_text`` (default: the
        prompt decoded with the engine's tokenizer; no text without one) and ``context["endpoint"]``."""
        if prompt_text is None and self.tokenizer is not None:
            prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        request: dict[str, Any] = {"prompt": prompt_text if prompt_text is not None else list(prompt_ids)}
        if prompt_text is not None:
            request["prompt_text"] = prompt_text
        return RequestGuard(request, {"request_id": request_id, "client": "", "endpoint": endpoint,
                                      "guardrail_policy": ""})

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams | BeamSearchParams, *,
                    grammar: Any = None, arrival: float | None = None, adapter: str | None = None,
                    guard: RequestGuard | None = None, prompt_text: str | None = None) -> EngineRequest:
        """Queue a request; its outputs come from later ``step()`` calls.

        The guardrails run here, at the engine boundary: the input rails when the request enters (once per
        ``guard``; a refusal raises before anything is queued), the output filters on every text delta it
        emits, ``plyx_on_response`` when it ends.

        Args:
            params: ``SamplingParams``; or ``BeamSearchParams``: a beam search whose ``num_beams`` rows share the
                prompt's blocks, and whose ``num_return_sequences`` best hypotheses come out when it ends (one
                output each, index = rank; no per-token outputs).
            adapter: a resident LoRA adapter's name (``lora=``), or None for the base model.
            guard: the guardrails of the caller's request (a server shares one among the prompts of an API
                call, and re-encodes a rewritten prompt itself); None: one is made for this request
                (``guard_for``) when ``EngineConfig.guardrails`` is on, and a rewritten prompt is re-encoded
                with the engine's tokenizer.
            prompt_text: the text the input rails see (default: the prompt decoded).

        Raises:
            ConfigError: a bad prompt, or structured output without a tokenizer.
            RequestRefused: an input rail refused the prompt.
            QueueFullError: ``max_queue`` requests are already waiting.
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; pass a unique id")
        self.check_prompt(prompt_ids)
        beam = None
        if isinstance(params, BeamSearchParams):  # its rows carry greedy SamplingParams; the group decides tokens
            check_beam_request(self, prompt_ids, params, adapter)
            beam, params = params, beam_rows_params(params)
        if guard is None and self.config.guardrails:
            guard = self.guard_for(request_id, prompt_ids, prompt_text)
            guard.admit()
            if guard.rewritten is not None:  # an input rail redacted the prompt: the model sees the new text
                if self.tokenizer is None:
                    raise ConfigError("prompt", "a guardrail rewrote the prompt, and the engine has no tokenizer "
                                      "to encode the new text", fix="build the Engine with tokenizer=...")
                prompt_ids = self.tokenizer.encode(guard.rewritten)
                self.check_prompt(prompt_ids, where="prompt (after the guardrail's rewrite)")
        elif guard is not None:
            guard.admit()  # once per guard: a no-op for the second prompt of an API call
        if adapter is not None and (self.lora is None or adapter not in self.lora.index):
            have = ", ".join(self.lora.names) if self.lora is not None else "none"
            raise ConfigError("adapter", f"adapter {adapter!r} is not resident (adapters: {have})", value=adapter,
                              fix="name a loaded adapter, or load it at startup (plyx serve --lora NAME=PATH)")
        if len({s.request.request_id for s in self.waiting}) >= self.config.max_queue:
            raise QueueFullError(self.config.max_queue)
        if params.structured is not None and grammar is None:
            grammar = self.compile_grammar(params)
        req = EngineRequest(request_id, [int(t) for t in prompt_ids], params, arrival)
        req.adapter = adapter
        order = next(self._order)
        stops = self._stop_ids(params)
        for i in range(params.n):
            matcher = None
            if grammar is not None:
                from plyx.serve._structured import new_matcher

                matcher = new_matcher(grammar, stops)
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            sid = next(self._seq_ids)
            completion = Completion(request_index=0, index=i, prompt_ids=req.prompt_ids, params=params,
                                    stop_ids=stops, context=self.max_model_len, tokenizer=self.tokenizer,
                                    seq_id=sid, generator=gen, matcher=matcher)
            seq = Sequence(req, i, sid, completion, gen, matcher, seed=admission_seed(self, params, i, sid))
            self._priority[sid] = (order, i)
            req.seqs.append(seq)
        for seq in req.seqs[1:]:
            seq.status = SeqStatus.FOLLOWER
        self._enqueue(req.seqs[0])
        self.requests[request_id] = req
        if beam is not None:
            self.beam_groups[request_id] = BeamGroup(self, req, beam, stops)
        if guard is not None:
            req.guard = guard
            guard.attach(request_id, len(req.prompt_ids), params.n if beam is None else beam.num_return_sequences)
            self._guards[request_id] = req
        return req

    def abort(self, request_id: str) -> list[EngineOutput]:
        """Stop a request now and free its blocks; returns its final (aborted) output, empty if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        req.aborted = True
        self.beam_groups.pop(request_id, None)
        for seq in req.seqs:
            self._free(seq)
            seq.status = SeqStatus.FINISHED
        req.finish_time = time.monotonic()
        self.stats.requests_aborted += 1
        if self._guards.pop(request_id, None) is not None:
            req.guard.finish(request_id, aborted=True)
        return [EngineOutput(request_id, 0, None, request_finished=True, aborted=True)]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet (or preempted back to the queue)."""
        return len({s.request.request_id for s in self.waiting})

    @property
    def num_running(self) -> int:
        return len(self.running)

    def cache_usage(self) -> float:
        """Share of KV blocks held (by running sequences and the prefix cache)."""
        u = self.cache.usage()
        return u.blocks_used / u.blocks_total

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run one batched forward and sample; the outputs of this step (their text through each
        request's output filters)."""
        outputs = self._step()
        return self._guard_outputs(outputs) if self._guards else outputs

    def _guard_outputs(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Each output's text through its request's output filters; a completion a filter blocked ends now
        (``finish_reason="content_filter"``, its blocks freed); a request that ended reports its response, and
        only its last output of the step carries ``request_finished``."""
        done: dict[str, EngineOutput] = {}  # guarded requests that ended this step -> their last output
        for out in outputs:
            req = self._guards.get(out.request_id)
            if req is None:
                continue
            ev = out.event
            if ev is not None:
                text, blocked = req.guard.feed(out.request_id, out.index, ev.text, ev.finish_reason,
                                               len(ev.token_ids))
                if blocked and ev.finish_reason != "content_filter":
                    self._block(req, out.index)
                    ev = msgspec.structs.replace(ev, text=text, finish_reason="content_filter")
                elif text is not ev.text:
                    ev = msgspec.structs.replace(ev, text=text)
                out.event = ev
            if out.request_finished or req.finished:
                out.request_finished = False
                done[out.request_id] = out
        for rid, last in done.items():
            last.request_finished = True
            req = self._guards.pop(rid)
            req.guard.finish(rid, aborted=last.aborted)
        return outputs

    def _block(self, req: EngineRequest, index: int) -> bool:
        """End completion ``index`` of ``req`` (an output filter blocked it, maybe on its last text); True when
        the request is done (then it is no longer in ``requests``)."""
        seq = req.seqs[index]
        seq.completion.finish_reason = "content_filter"  # type: ignore[assignment]  # also over "stop"/"length"
        if seq.status is not SeqStatus.FINISHED:
            self._free(seq)
            seq.status = SeqStatus.FINISHED
        if not req.finished:
            return False
        if req.request_id in self.requests:  # it ended here, not in this step's sampling
            req.finish_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self.stats.requests_finished += 1
        return True

    @torch.inference_mode()
    def _step(self) -> list[EngineOutput]:
        if self._block_ahead is not None:  # the multi-step block the last step queued before reading its own
            outputs = accept_ahead(self)
            if outputs or self._block_ahead is not None:
                return outputs
        planned = self._schedule()
        if not planned:
            return []
        self.stats.steps += 1
        self.stats.last_batch_seqs = len(planned)
        self.stats.last_batch_tokens = sum(n for _, n in planned)
        if self.spec_graphs is not None and self._drafts:  # a graph-replayed verification step
            from plyx.serve.engine._spec_graphs import spec_step

            outputs = spec_step(self, planned)
            if outputs is not None:
                return outputs
        # beam groups need their logits every step (host logic between tokens): single steps while one runs
        k = block_steps(self, planned) if self.decode_steps > 1 and not self._spec_step and not self.beam_groups else 1
        if k > 1:  # a block of k decode steps, the tokens read once (``_multistep``)
            seqs = [s for s, _ in planned]
            self.stats.steps += k - 1
            self.stats.multi_step_blocks += 1
            return run_block(self, seqs, k)
        # rows whose logits the previous step's look-ahead computed sample without a forward
        finishing = [s for s, n in planned if n == 0]
        rows = [self._ahead.pop(s.seq_id) for s in finishing]
        work = [(s, n) for s, n in planned if n > 0]
        verify: list[tuple[Sequence, list[int], int]] = []  # speculating rows: (seq, drafts, offset in greedy)
        greedy: torch.Tensor | None = None
        if work and self.packed and not self._graph_step(work):
            step_rows, verify, greedy = self._forward_packed(work, finishing)
            rows += step_rows
        elif work:
            for group in self._groups(work):
                rows.extend(self._forward(group, finishing))
        outputs: list[EngineOutput] = []
        if finishing and self.beam_groups:  # beam rows: their groups' search steps, not sampling
            finishing, rows, beam_outputs = step_beams(self, finishing, rows)
            outputs.extend(beam_outputs)
        if finishing:
            seqs, logits = self._with_followers(finishing, rows)  # [R, V]
            ahead: list[Any] = []
            launch = (lambda tokens: ahead.extend(self._look_ahead_step(seqs, tokens))) if self.look_ahead else None
            tokens, logprobs = sample_rows(seqs, logits, self.generator, before_sync=launch)
            for seq, tok, lp in zip(seqs, tokens, logprobs):
                outputs.extend(self._accept(seq, tok, lp))
            if ahead:
                self._keep_ahead(*ahead)
        if verify:
            outputs.extend(self._verify_drafts(verify, greedy.tolist()))  # type: ignore[union-attr]
        if self.proposer is not None:  # the heads over this step's captured features: the next step's drafts
            self.proposer.draft(self.running, self.generator)
        return outputs

    def _draft_proposer(self, heads: Any) -> Any:
        """The ``HeadsProposer`` of ``draft_heads`` (None without heads); a ConfigError where they cannot run."""
        c = self.config
        if heads is None:
            if c.speculative_k or c.spec_tree > 1:
                name = "speculative_k" if c.speculative_k else "spec_tree"
                raise ConfigError(f"EngineConfig.{name}", f"{name} applies to draft heads, and none are given",
                                  value=getattr(c, name), fix="pass draft_heads (plyx serve: --draft-heads PATH)")
            return None
        if c.speculative_ngram:
            raise ConfigError("EngineConfig.speculative_ngram", "draft heads and prompt-lookup speculation both "
                              "propose drafts; the engine runs one proposer", value=c.speculative_ngram,
                              fix="set speculative_ngram=0 or drop draft_heads")
        if not self.packed:
            raise ConfigError("EngineConfig.draft_heads", "draft heads ride in the packed step, which this engine "
                              "does not run (packed_step off or resident adapters)",
                              value=str(heads) if isinstance(heads, str) else type(heads).__name__,
                              fix="leave packed_step on and serve without --lora")
        if c.spec_tree > 1 and getattr(self.cache, "kv_scales", None) is not None:  # int8 / fp8 pools
            # a tree group gathers its keys and values from the pools as stored (plyx.attn.tree_attention);
            # chains attend through paged_attention_quant like every other row
            raise ConfigError("EngineConfig.spec_tree", f"tree verification reads the pools unquantised, and this "
                              f"cache stores {c.kv_cache_dtype}", value=c.spec_tree,
                              fix="use chains (spec_tree=0 / no --spec-tree) or kv_cache_dtype 'auto' or 'bf16'")
        from plyx.serve.engine._draft_proposer import HeadsProposer

        return HeadsProposer.build(heads, self.model, k=c.speculative_k, topk=c.spec_tree)

    def _speculates(self, seq: Sequence) -> bool:
        """Whether a decoding row may feed drafts: plain greedy (argmax verification is then exact), no
        log-probs asked, base model; with draft-head chains also plain sampled rows (the rejection rule)."""
        from plyx.serve.engine._sampling import plain_greedy

        if seq.request.request_id in self.beam_groups:  # a beam's next token is the group's choice, not argmax
            return False
        if plain_greedy(seq) and seq.params.logprobs is None and seq.request.adapter is None:
            return True
        return self.proposer is not None and self.proposer.samples(seq)

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """This step's drafts of a decoding row: at most what its length limit, the context and the step's
        token budget leave after its one real token."""
        from plyx.serve._ngram import propose

        c = self.config
        if self.proposer is not None:  # a tree's depth bounds what it emits; its size what it feeds
            depth = min(self.spec_k, seq.completion.limit - len(seq.completion.token_ids) - 1)
            drafts, parents = self.proposer.propose(seq, depth, min(self.max_model_len - len(seq.tokens), budget - 1))
            if parents is not None:
                self._draft_parents[seq.seq_id] = parents
            return drafts
        room = min(self.spec_k, seq.completion.limit - len(seq.completion.token_ids) - 1,
                   self.max_model_len - len(seq.tokens), budget - 1)
        return propose(seq.tokens, room, c.prompt_lookup_min, c.prompt_lookup_max) if room > 0 else []

    def _verify_drafts(self, rows: list[tuple[Sequence, list[int], int]], greedy: list[int]) -> list[EngineOutput]:
        """Greedy verification: a row keeps its drafts up to the first the target's argmax disagrees with (a tree
        row: its deepest path of agreeing nodes, ``accepted_path``), plus the argmax there (the token plain greedy
        decoding would emit next). A tree's accepted nodes are moved to the slots after the root
        (``plyx.attn.move_tokens``); the rejected drafts' keys and values are cropped from the cache."""
        from plyx.serve.engine._draft_proposer import accepted_path

        outputs: list[EngineOutput] = []
        kept: list[tuple[Sequence, list[int], list[int], int]] = []  # (seq, path, tokens, fed index of the last)
        moves = []
        for seq, drafts, offset in rows:
            choice = greedy[offset:offset + len(drafts) + 1]  # argmax after the real token and after each draft
            parents = self._draft_parents.get(seq.seq_id)
            if seq.params.greedy or self.proposer is None:
                path = accepted_path(drafts, parents if parents is not None else range(-1, len(drafts)), choice)
            else:  # a sampled chain: the rejection rule against the target's processed distributions
                rows_logits = self.proposer.verify_logits[offset:offset + len(drafts) + 1]  # type: ignore[index]
                accepted, token = self.proposer.verify_sampled(seq, drafts, rows_logits, self.generator)
                path, choice = list(range(1, accepted + 1)), choice[:accepted] + [token]
            last = path[-1] if path else 0
            if path != list(range(1, len(path) + 1)):  # a tree branch: its nodes follow the root in the cache
                root = seq.num_computed - 1
                moves.append((seq.seq_id, [root + j for j in path], [root + 1 + i for i in range(len(path))]))
            kept.append((seq, path, [drafts[j - 1] for j in path] + [choice[last]], offset + last))
            self.stats.spec_drafted += len(drafts)
            self.stats.spec_accepted += len(path)
            self.stats.spec_rows += 1
        if moves:
            from plyx.attn import move_tokens

            move_tokens(self.cache, moves)
        hidden = self.proposer.verify_hidden if self.proposer is not None else None
        for seq, path, tokens, at in kept:
            seq.num_computed += len(path)  # the accepted drafts' keys and values stay
            outputs.extend(self._accept_tokens(seq, tokens))
            if seq.status is not SeqStatus.FINISHED:
                self.cache.crop(seq.seq_id, seq.num_computed)
                if hidden is not None:  # the state whose argmax gave the row's new last token
                    self.proposer.capture([seq], hidden[at:at + 1])  # type: ignore[union-attr]
        return outputs

    def _accept_tokens(self, seq: Sequence, tokens: list[int]) -> list[EngineOutput]:
        """``_accept`` of several tokens at once (the completion takes them up to the first that finishes it)."""
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        event = seq.completion.add(tokens)
        if event is not None:
            seq.tokens.extend(event.token_ids)
            self.stats.generated_tokens += len(event.token_ids)
        if not seq.completion.finished:
            return [EngineOutput(req.request_id, seq.index, event)]
        if seq.num_computed > len(seq.tokens) - 1:  # finished inside the accepted drafts: nothing to keep anyway
            seq.num_computed = len(seq.tokens) - 1
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        done = req.finished
        if done:
            req.finish_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self.stats.requests_finished += 1
        return [EngineOutput(req.request_id, seq.index, event, request_finished=done)]

    def _look_ahead_step(self, seqs: list[Sequence], tokens: torch.Tensor) -> tuple[list[Sequence], torch.Tensor] | tuple[()]:
        """Queue the forward of each row's just-sampled token (``tokens [R]``, still on the device) when the next step
        would be exactly that decode step: every running sequence sampled, nothing waits, the blocks are free.

        Rows that reach their length limit are left out (they finish); rows that end by EOS or a stop string are
        only known after the host reads the tokens: their share of this forward is wasted and their blocks freed.
        Returns ``(rows, logits [r, V])``, or ``()`` when nothing was queued.
        """
        if self.waiting or self.beam_groups or any(s.pending for s in self.running):
            return ()
        if self.decode_steps > 1 and all(multi_step_row(s) or s.finished for s in seqs):
            return ()  # the next step runs a multi-step block (it needs its rows' tokens on the host first)
        keep = [i for i, s in enumerate(seqs) if len(s.completion.token_ids) + 1 < s.completion.limit]
        if not keep:
            return ()
        rows = [seqs[i] for i in keep]
        ids = [s.seq_id for s in rows]
        if len(set(ids)) != len(ids) or self.cache.blocks_needed(ids, [1] * len(ids)) > self.cache.num_free_blocks():
            return ()
        if len(keep) != len(seqs):
            tokens = tokens.index_select(0, torch.tensor(keep, device=tokens.device))
        if self.graphs is not None and self.graphs.bucket(len(rows)) is not None:
            # the graph's output buffer is overwritten by its next replay: this step's rows keep a copy
            return rows, self.graphs.step(ids, tokens).clone()  # [r, V]
        if not self.packed:  # no bucket holds the batch and packed steps are off: the next step feeds it
            return ()
        from plyx.attn import begin_packed_step

        ids_t, positions, step = begin_packed_step(self.cache, ids, [1] * len(ids), tokens, self.device)
        out = self.model(ids_t, position_ids=positions, kv_step=step, return_hidden=self._lm_head)  # [1, r, D|V]
        return rows, self._logits(out[0])  # [r, V]

    def _keep_ahead(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        """After the tokens were accepted: the looked-ahead token of every row still running is computed."""
        for seq, row in zip(rows, logits.unbind(0)):
            if seq.status is SeqStatus.RUNNING and not seq.finished:
                seq.num_computed += 1  # == len(seq.tokens): pending 0, its next logits wait in _ahead
                self._ahead[seq.seq_id] = row
                self.stats.looked_ahead += 1

    def _graph_step(self, planned: list[tuple[Sequence, int]]) -> bool:
        """A decode-only step that a captured graph bucket holds (replayed instead of a packed eager forward).
        Not with rows the draft heads read: decode graphs return logits, the heads need hidden states."""
        return (self.graphs is not None and all(n == 1 for _, n in planned)
                and self.graphs.bucket(len(planned)) is not None
                and (self.proposer is None or not any(self._speculates(s) for s, _ in planned)))

    def _forward_packed(self, planned: list[tuple[Sequence, int]], finishing: list[Sequence]
                        ) -> tuple[list[torch.Tensor], list[tuple[Sequence, list[int], int]], torch.Tensor | None]:
        """One forward over every scheduled token (``plyx.attn.begin_packed_step``).

        Rows go decodes first, then prefill chunks by length, so rows feeding equal token counts lie next to each
        other and share one attention launch per layer; everything else runs once over all ``N`` tokens.

        Returns the last position's logits ``[V]`` of the rows that reached their end (they sample, in
        ``finishing`` order); the speculating rows ``(seq, drafts, offset)``; and the argmax ``[M]`` after each
        of their fed tokens (row r's at ``offset .. offset + len(drafts)``), or None.
        """
        from plyx.attn import begin_packed_step

        group = sorted(planned, key=lambda p: p[1])  # stable: arrival order within a length
        counts = [n for _, n in group]
        drafts = self._drafts
        tokens = [t for s, n in group
                  for t in (s.tokens[s.num_computed:] + drafts[s.seq_id] if s.seq_id in drafts
                            else s.tokens[s.num_computed:s.num_computed + n])]
        seq_ids = [s.seq_id for s, _ in group]
        # tree rows: those whose drafts the schedule kept (a proposal without room was dropped, parents and all)
        trees = {i: self._draft_parents[s.seq_id] for i, (s, _) in enumerate(group)
                 if s.seq_id in drafts and s.seq_id in self._draft_parents}
        mixed = self.mixed_graphs
        if mixed is not None and not trees and mixed.fits(len(group), len(tokens)):  # a replayed graph of the bucket
            out = mixed.step(seq_ids, counts, tokens)  # [N, D|V], a view of the graph's buffer
        else:  # token trees (draft heads, spec_tree) run eagerly: their masks are not in the captured graphs
            ids, positions, step = begin_packed_step(self.cache, seq_ids, counts, tokens, self.device,
                                                     tree_parents=trees or None)
            out = self.model(ids, position_ids=positions, kv_step=step, return_hidden=self._lm_head)[0]  # [N, D|V]
        ends = list(itertools.accumulate(counts))  # row i's last token is ends[i] - 1
        plain = [i for i, (s, _) in enumerate(group) if s.seq_id not in drafts]
        done = self._advance([group[i] for i in plain], finishing)
        picks = [ends[plain[j]] - 1 for j in done]
        verify: list[tuple[Sequence, list[int], int]] = []
        for i, (seq, n) in enumerate(group):
            if seq.seq_id in drafts:  # its real token is computed; the drafts wait for verification
                seq.num_computed += 1
                verify.append((seq, drafts[seq.seq_id], len(picks) - len(done)))
                picks.extend(range(ends[i] - n, ends[i]))
        if not picks:
            return [], [], None
        # the LM head only on rows that sample and on speculating rows' fed positions
        hidden = out.index_select(0, torch.tensor(picks, device=self.device))  # [R + M, D|V]
        logits = self._logits(hidden)  # [R + M, V]
        if self.proposer is not None:  # draft heads read these states: sampled greedy rows now, verified rows later
            rows_done = [group[plain[j]][0] for j in done]
            keep = [j for j, s in enumerate(rows_done) if self._speculates(s)]
            if keep:
                self.proposer.capture([rows_done[j] for j in keep], hidden[keep])
            self.proposer.verify_hidden = hidden[len(done):]
            self.proposer.verify_logits = logits[len(done):]
        greedy = logits[len(done):].argmax(dim=-1) if verify else None  # [M]
        return list(logits[:len(done)].unbind(0)), verify, greedy

    def _groups(self, planned: list[tuple[Sequence, int]]) -> Iterable[list[tuple[Sequence, int]]]:
        """Rows of equal new-token counts share a forward (no padding); long chunks also need equal cached
        lengths, because the gathered-keys attention path would otherwise need a key mask."""
        from plyx.attn import PAGED_MAX_QUERY

        groups: dict[Any, list[tuple[Sequence, int]]] = {}
        mixed = self._mixed
        width = max((n for _, n in planned if n <= mixed), default=0)
        for seq, n in planned:
            if n <= mixed and seq.num_computed + n >= width:
                # one left-padded forward of width T: the paged kernel needs every row to hold >= T tokens
                key: Any = "mixed"
            else:
                key = n if n <= PAGED_MAX_QUERY else (n, seq.num_computed)
            groups.setdefault(key, []).append((seq, n))
        return groups.values()

    def _forward(self, group: list[tuple[Sequence, int]], finishing: list[Sequence]) -> list[torch.Tensor]:
        """Feed each row its next ``n`` tokens; the last position's logits ``[V]`` of rows that reached their end."""
        width = max(n for _, n in group)
        seq_ids = [s.seq_id for s, _ in group]
        if width == 1 and self.graphs is not None and self.graphs.bucket(len(group)) is not None:
            tokens = [s.tokens[s.num_computed] for s, _ in group]  # host ints: they ride in the step's one copy
            logits = self.graphs.step(seq_ids, tokens)  # [B, V], the graph's buffer: copied by the stack below
            return [logits[i] for i in self._advance(group, finishing)]
        mask = None
        if any(n != width for _, n in group):  # a mixed group: left padding, the last column is real in every row
            rows_ids = [[0] * (width - n) + s.tokens[s.num_computed:s.num_computed + n] for s, n in group]
            mask = torch.tensor([[0] * (width - n) + [1] * n for _, n in group], device=self.device)
        else:
            rows_ids = [s.tokens[s.num_computed:s.num_computed + n] for s, n in group]
        ids = torch.tensor(rows_ids, dtype=torch.long, device=self.device)  # [B, T]
        kw: dict[str, Any] = {"cache": self.cache, "seq_ids": seq_ids, "attention_mask": mask}
        if self.lora is not None:  # each row through its own adapter (or the base), in this one forward
            self.lora.activate([s.request.adapter for s, _ in group])
        try:
            if self._lm_head:
                out = self.model(ids, return_hidden=True, **kw)  # [B, T, D]
            else:
                out = self.model(ids, **kw)  # [B, T, V]
        finally:
            if self.lora is not None:
                self.lora.clear()
        done = self._advance(group, finishing)
        if not done:
            return []
        logits = self._logits(out[done, -1])  # [R, V]: the LM head only on rows that sample
        return list(logits.unbind(0))

    def _advance(self, group: list[tuple[Sequence, int]], finishing: list[Sequence]) -> list[int]:
        """Count the group's tokens as computed; the rows that reached their end (they sample), in order."""
        done = []
        for i, (seq, n) in enumerate(group):
            first = seq.num_computed
            seq.num_computed += n
            if first < len(seq.request.prompt_ids):
                self.stats.prompt_tokens += min(n, len(seq.request.prompt_ids) - first)
            self._register_prefix(seq)
            if seq.pending == 0:
                finishing.append(seq)
                done.append(i)
        return done

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._lm_head:
            return hidden.float()
        return torch.matmul(hidden, self.model.lm_head_weight.t()).float()  # [R, V]

    def _with_followers(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> tuple[list[Sequence], torch.Tensor]:
        """Completions 1..n-1 of a request whose prompt was just computed fork its cache and sample from its row."""
        out_seqs, out_rows = [], []
        for seq, row in zip(seqs, rows):
            out_seqs.append(seq)
            out_rows.append(row)
            if seq.index == 0 and len(seq.tokens) == len(seq.request.prompt_ids):
                for f in seq.request.seqs[1:]:
                    if f.status is SeqStatus.FOLLOWER:
                        self.cache.fork(seq.seq_id, f.seq_id)  # shares every block; copy-on-write later
                        f.num_computed = seq.num_computed
                        f.status = SeqStatus.RUNNING
                        self.running.append(f)
                        out_seqs.append(f)
                        out_rows.append(row)
        return out_seqs, torch.stack(out_rows)

    def _accept(self, seq: Sequence, token: int, logprob: Any) -> list[EngineOutput]:
        req = seq.request
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        event = seq.completion.add([token], [logprob] if logprob is not None else None)
        if not seq.completion.finished:
            return [EngineOutput(req.request_id, seq.index, event)]
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        done = req.finished
        if done:
            req.finish_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self.stats.requests_finished += 1
        return [EngineOutput(req.request_id, seq.index, event, request_finished=done)]

    def _register_prefix(self, seq: Sequence) -> None:
        if self.prefix is None or seq.request.adapter is not None:  # an adapter's KV is its own: not shared
            return
        computed = min(seq.num_computed, len(seq.request.prompt_ids))
        if computed // self.config.block_size > seq.prefix_depth:
            seq.prefix_node = self.prefix.insert(seq.seq_id, seq.tokens, computed, seq.prefix_node, seq.prefix_depth)
            seq.prefix_depth = computed // self.config.block_size

    # -- scheduling ------------------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, int]:
        return self._priority[seq.seq_id]

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        keys = [self._key(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._key(seq)), seq)

    def _free(self, seq: Sequence) -> None:
        """Drop a sequence's cache entry and take it out of the queues."""
        self._ahead.pop(seq.seq_id, None)
        try:
            self.cache.evict(seq.seq_id)
        except KeyError:
            pass  # never admitted, or preempted
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, keep the tokens (and generator and grammar state)."""
        self._free(seq)
        seq.num_computed = 0
        seq.prefix_node, seq.prefix_depth = None, 0
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(seq)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_batch_tokens
        if self.mixed_graphs is not None:  # every step fits a captured bucket: no eager step, no compile mid-serving
            budget = min(budget, self.mixed_graphs.max_tokens)
        planned: dict[Sequence, tuple[int, int]] = {}  # seq -> (tokens, blocks)
        # before the drafts are reset: the rule reads whether the previous step had any
        speculate = self._spec_step = bool(self.spec_k) and (self.spec_policy is None or self.spec_policy.decide(self))
        self._drafts = {}
        self._draft_parents = {}
        preempted = False

        taken = 0  # blocks the planned rows will take: kept as a sum (summing planned per call is O(B^2))

        def free_blocks() -> int:
            return self.cache.num_free_blocks() - taken

        def make_room(seq: Sequence, need: int) -> bool:
            """Evict prefix blocks, then preempt lower-priority running sequences, until ``need`` blocks are free."""
            nonlocal budget, preempted, taken
            while need > free_blocks():
                if self.prefix is not None and self.prefix.evict(need - free_blocks()):
                    continue
                victims = [s for s in self.running if s is not seq and self._key(s) > self._key(seq)]
                if not victims:
                    return False
                victim = max(victims, key=self._key)
                if victim in planned:
                    self._drafts.pop(victim.seq_id, None)
                    self._draft_parents.pop(victim.seq_id, None)
                    n, blocks = planned.pop(victim)
                    budget += n
                    taken -= blocks
                self._preempt(victim)
                preempted = True
            return True

        mixed = self._mixed

        def chunk(seq: Sequence) -> int:
            n = min(seq.pending, budget)
            if mixed and any(p.pending == 1 for p in planned):  # ride along in the decodes' forward
                n = min(n, mixed)
            return n

        # 1. running sequences: decodes first, then prefill chunks; by arrival within each
        for seq in sorted(self.running, key=lambda s: (s.pending > 1, self._key(s))):
            if seq.status is not SeqStatus.RUNNING or seq in planned:
                continue
            if budget == 0:
                break
            n = chunk(seq)
            need = self.cache.blocks_needed([seq.seq_id], [n])
            if not make_room(seq, need):
                self._preempt(seq)
                preempted = True
                continue
            if speculate and n == 1 and seq.pending == 1 and self._speculates(seq):
                drafts = self._propose(seq, budget)
                more = self.cache.blocks_needed([seq.seq_id], [1 + len(drafts)]) if drafts else need
                if drafts and more <= free_blocks():  # drafts never evict or preempt anything
                    self._drafts[seq.seq_id] = drafts
                    n, need = 1 + len(drafts), more
            planned[seq] = (n, need)
            taken += need
            budget -= n
        # 2. admissions, in arrival order, while nothing had to be preempted this step
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            joining = sum(1 for s in seq.request.seqs if s is seq or s.status is SeqStatus.FOLLOWER)
            if self.running and len(self.running) + joining > self.config.max_batch_size:
                break
            nodes = []
            if self.prefix is not None and seq.request.adapter is None:  # the cache holds base-model KV only
                nodes = self.prefix.match(seq.tokens, max_tokens=len(seq.tokens) - 1)
            if nodes:
                seq.num_computed = self.prefix.attach(nodes, seq.seq_id)  # type: ignore[union-attr]
            else:
                self.cache.allocate(seq.seq_id)
                seq.num_computed = 0
            n = chunk(seq)
            need = self.cache.blocks_needed([seq.seq_id], [n])
            if need > free_blocks() and self.prefix is not None:
                self.prefix.evict(need - free_blocks())
            if need > free_blocks():
                self.cache.evict(seq.seq_id)  # undo: the sequence waits for blocks
                seq.num_computed = 0
                break
            if self.prefix is not None:
                self.prefix.record(len(seq.tokens), len(nodes) * self.config.block_size)
                seq.prefix_node, seq.prefix_depth = (nodes[-1], len(nodes)) if nodes else (None, 0)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            planned[seq] = (n, need)
            taken += need
            budget -= n
        return [(s, n) for s, (n, _) in planned.items()]

    # -- convenience ---------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: Any) -> list[RequestOutput]:
        """Run ``prompts`` (token ids) to completion through the scheduler; one ``RequestOutput`` each, in order.
        ``params``: one ``SamplingParams`` or ``BeamSearchParams`` for all, or one per prompt (mixed freely)."""
        one = isinstance(params, (SamplingParams, BeamSearchParams))
        plist = [params] * len(prompts) if one else list(params)
        base = f"gen-{next(self._order)}-"
        reqs = [self.add_request(f"{base}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        while any(not r.finished for r in reqs):
            self.step()
        return [self.request_output(r, i) for i, r in enumerate(reqs)]

    def request_output(self, req: EngineRequest, index: int = 0) -> RequestOutput:
        """``req``'s completions so far as a ``RequestOutput`` (``request_index=index``), each text as its output
        filters let it out."""
        guard = req.guard if req.guard is not None and req.guard.filtering else None
        outs = []
        finals = req.beam_outputs
        for s in req.seqs if finals is None else ():
            out = s.completion.output()
            if guard is not None and out.text is not None:
                out = msgspec.structs.replace(out, text=guard.text(req.request_id, s.index))
            outs.append(out)
        for out in finals or ():  # a beam request: its best hypotheses, best first
            if guard is not None and out.text is not None:
                out = msgspec.structs.replace(out, text=guard.text(req.request_id, out.index))
            outs.append(out)
        return RequestOutput(request_index=index, prompt=None, prompt_token_ids=tuple(req.prompt_ids),
                             outputs=tuple(outs))
