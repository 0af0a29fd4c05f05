"""``generate()`` and ``stream_generate()``: batched decoding of many prompts with any KV cache.

The loop, per step: processors and sampler on the ``[B, V]`` logits (on device), one host copy of
the B chosen tokens (needed anyway for stop rules and streaming), then one forward pass of the
rows still running. Finished rows leave the batch at once (their cache sequences are evicted), so a
batch never pays for its longest member.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from plyx.serve._completion import Completion
from plyx.serve._outputs import RequestOutput, StreamEvent, TokenLogprob
from plyx.serve._params import SamplingParams
from plyx.serve._pipeline import LogitsPipeline, check_plugin_names
from plyx.serve._processors import SamplingState
from plyx.serve._runner import Runner, model_device
from plyx.serve._structured import GrammarMask, compile_structured, new_matcher
from plyx.serve._tokenizer import TokenizerView
from plyx.specs.errors import ConfigError
from plyx.specs.kvcache import KVCache

__all__ = ["GenerationStream", "generate", "stream_generate"]

Prompt = str | Sequence[int]


# ---------------------------------------------------------------------------
# validation: everything that can be wrong is found before any compute
# ---------------------------------------------------------------------------
def _check_model(model: Any, name: str = "model") -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size") or not hasattr(config, "max_seq_len"):
        raise ConfigError(name, "the model must have a plyx.specs.ModelConfig at `.config`",
                          value=type(model).__name__, fix="pass a plyx.model.TransformerLM (or a model with .config)")
    return config


def _normalize_prompts(prompts: Any, tokenizer: TokenizerView | None) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError("prompts", "prompts must be a non-empty list of strings or of token-id lists",
                          value=prompts, fix='pass e.g. ["Hello"] (with a tokenizer) or [[1, 2, 3]]')
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError(f"prompts[{i}]", "a text prompt needs a tokenizer", value=p[:40],
                                  fix="pass tokenizer=... or give token ids")
            ids.append(tokenizer.encode(p))
            texts.append(p)
        else:
            try:
                ids.append([int(t) for t in p])
            except (TypeError, ValueError):
                raise ConfigError(f"prompts[{i}]", "a prompt must be a string or a list of token ids",
                                  value=p, fix="pass token ids as ints") from None
            texts.append(None)
        if not ids[-1]:
            raise ConfigError(f"prompts[{i}]", "the prompt is empty", value=p,
                              fix="give at least one token (e.g. the BOS id)")
    return ids, texts


def _normalize_params(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n or not all(isinstance(p, SamplingParams) for p in plist):
        raise ConfigError("params", f"params must be one SamplingParams or a list of {n} (one per prompt)",
                          value=f"{len(plist)} items", fix="pass one SamplingParams per prompt")
    return plist


def _eos_ids(eos_token_id: int | Sequence[int] | None, tokenizer: TokenizerView | None) -> list[int]:
    if eos_token_id is None:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        return [] if eos is None else [int(eos)]
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(t) for t in eos_token_id]


class _Plan:
    """Validated inputs of one ``generate`` call."""

    def __init__(self, model: Any, prompts: Any, params: Any, tokenizer: Any, eos_token_id: Any) -> None:
        self.config = _check_model(model)
        self.vocab = int(self.config.vocab_size)
        self.context = int(self.config.max_seq_len)
        self.tokenizer = TokenizerView(tokenizer) if tokenizer is not None else None
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.vocab:
            raise ConfigError("tokenizer", f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                              f"vocabulary has {self.vocab} rows", value=self.tokenizer.vocab_size,
                              fix="use the tokenizer the model was trained with")
        self.prompt_ids, self.prompt_texts = _normalize_prompts(prompts, self.tokenizer)
        self.params = _normalize_params(params, len(self.prompt_ids))
        self.eos = _eos_ids(eos_token_id, self.tokenizer)
        self.grammars: list[Any] = []
        for i, (ids, p) in enumerate(zip(self.prompt_ids, self.params)):
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ConfigError(f"prompts[{i}]", f"token ids must be in [0, {self.vocab})", value=bad[:5],
                                  fix="encode the prompt with the model's tokenizer")
            if len(ids) >= self.context:
                raise ConfigError(f"prompts[{i}]", f"the prompt has {len(ids)} tokens but the model's context is "
                                  f"{self.context}, which leaves no room for a new token", value=len(ids),
                                  fix=f"shorten the prompt to at most {self.context - 1} tokens")
            where = f"params[{i}]" if not isinstance(params, SamplingParams) else "params"
            if (p.stop or p.structured is not None) and self.tokenizer is None:
                what = "stop strings" if p.stop else "structured output"
                raise ConfigError(f"{where}.{'stop' if p.stop else 'structured'}", f"{what} need a tokenizer",
                                  fix="pass tokenizer=... to generate()")
            check_plugin_names(p, where)
            grammar = None
            if p.structured is not None:
                if not self.eos:
                    raise ConfigError("eos_token_id", "structured output needs an EOS token id to end the grammar",
                                      fix="pass eos_token_id=... (or a tokenizer that defines one)")
                assert self.tokenizer is not None
                grammar = compile_structured(p.structured, self.tokenizer, self.vocab, self.eos,
                                             where=f"{where}.structured")
            self.grammars.append(grammar)

    def longest(self, extra: int = 0) -> int:
        """Most tokens any sequence can hold (prompt + max_new_tokens + ``extra``, capped by the context):
        a cache built from a kind name is sized to this, not to the model's whole context."""
        need = max(len(ids) + p.max_new_tokens for ids, p in zip(self.prompt_ids, self.params))
        return min(self.context, need + extra)

    def stop_ids(self, p: SamplingParams) -> list[int]:
        return ([] if p.ignore_eos else list(self.eos)) + [t for t in p.stop_token_ids if t not in self.eos]


def _seeded(p: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    if p.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(p.seed + index)
    return gen


#: plain greedy decoding on CUDA graphs runs up to this many one-token steps per replay (a power of two):
#: the per-step host work, copies and launch are paid once per group, and a stream receives tokens in groups
GREEDY_STEPS = 8


def _plain_greedy(pipeline: LogitsPipeline, rows: Sequence[Completion]) -> bool:
    """Every row greedy through the built-in sampler, nothing processing the logits, no log-probs asked."""
    from plyx.serve._processors import GreedySampler

    return (not pipeline.processors and len(pipeline.samplers) == 1
            and type(pipeline.samplers[0][0]) is GreedySampler and all(c.params.logprobs is None for c in rows))


def _looks_ahead(device: torch.device) -> bool:
    """Queue step N + 1 before reading step N's tokens: only where the device runs asynchronously (CUDA);
    on a CPU the forward runs inline, so looking ahead would only add the rows that end by EOS."""
    return device.type == "cuda"


def _to_host(tokens: torch.Tensor) -> Any:
    """Start copying ``tokens`` to the host; the returned callable waits for the copy and gives the list."""
    if tokens.device.type != "cuda":
        return tokens.tolist
    pinned = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    pinned.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def wait() -> list[int]:
        done.synchronize()
        return pinned.tolist()

    return wait


def _device_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices as a long tensor on ``device``, copied without waiting for the GPU: a plain
    ``torch.as_tensor(list, device=cuda)`` copies from pageable memory, which waits for every queued
    kernel (at the start of a call, the whole prefill) before the host can queue anything else."""
    index = torch.tensor(list(rows), dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[Completion]) -> list[list[TokenLogprob] | None]:
    """Log-probabilities of the chosen tokens (and top alternatives) of the rows that asked; one host copy."""
    want = [c.params.logprobs for c in rows]
    if all(w is None for w in want):
        return [None] * len(rows)
    lp = raw.float().log_softmax(dim=-1)  # [B, V]
    chosen = lp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(w or 0 for w in want)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    tv = top_v.tolist() if top_v is not None else None
    ti = top_i.tolist() if top_i is not None else None
    toks = tokens.tolist()
    out: list[list[TokenLogprob] | None] = []
    for r, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top = tuple(zip(ti[r][:w], tv[r][:w])) if w and ti is not None and tv is not None else ()
        out.append([TokenLogprob(toks[r], chosen[r], top)])
    return out


# ---------------------------------------------------------------------------
# the public functions
# ---------------------------------------------------------------------------
def stream_generate(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    tokenizer: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache: str | KVCache = "contiguous",
    use_cache: bool = True,
    draft_model: Any = None,
    num_speculative_tokens: int = 4,
    draft_cache: str | KVCache = "contiguous",
    generator: torch.Generator | None = None,
    cuda_graphs: bool | None = None,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 3,
) -> GenerationStream:
    """Decode ``prompts`` and yield each completion's new tokens as they are produced.

    Same arguments as ``generate``. Every input is validated when this is called (before the first
    ``next``), and the cache sequences it allocated are evicted when the iterator finishes or is closed.
    Plain greedy requests decoded through CUDA graphs arrive in events of up to ``GREEDY_STEPS`` (8)
    tokens: that many steps run per graph replay.

    Example:
        >>> for event in stream_generate(model, ["Once"], SamplingParams(max_new_tokens=8), tokenizer=tok):
        ...     print(event.text, end="", flush=True)
    """
    plan = _Plan(model, prompts, params, tokenizer, eos_token_id)
    if draft_model is not None:
        from plyx.serve._draft_heads import HeadsDecoder, is_draft_heads
        from plyx.serve._speculative import SpeculativeDecoder

        decoder = HeadsDecoder if is_draft_heads(draft_model) else SpeculativeDecoder  # Medusa/EAGLE heads
        spec = decoder(plan, model, draft_model, num_speculative_tokens=num_speculative_tokens,
                                  cache=cache if use_cache else None, draft_cache=draft_cache if use_cache else None,
                                  prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max)
        return GenerationStream(plan, spec.rows, spec.run(generator))
    rows, events = _decode(plan, model, cache if use_cache else None, generator, cuda_graphs)
    return GenerationStream(plan, rows, events)


class GenerationStream:
    """The iterator ``stream_generate`` returns: ``StreamEvent``s, then ``outputs()`` once exhausted."""

    def __init__(self, plan: _Plan, rows: list[Completion], events: Iterator[StreamEvent]) -> None:
        self._plan = plan
        self._rows = rows
        self._events = events

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop early; the cache sequences generate allocated are evicted."""
        self._events.close()  # type: ignore[attr-defined]

    def outputs(self) -> list[RequestOutput]:
        """The ``RequestOutput`` of every prompt so far (complete once the iterator is exhausted)."""
        return _outputs(self._plan, self._rows)


def _decode(plan: _Plan, model: Any, cache: str | KVCache | None, generator: torch.Generator | None,
            cuda_graphs: bool | None = None) -> tuple[list[Completion], Iterator[StreamEvent]]:
    device = model_device(model)
    total_rows = sum(p.n for p in plan.params)
    runner = Runner(model, cache, num_sequences=total_rows, max_seq_len=plan.longest(), cuda_graphs=cuda_graphs)
    rows: list[Completion] = []
    for r, (ids, p) in enumerate(zip(plan.prompt_ids, plan.params)):
        for j in range(p.n):
            stop = plan.stop_ids(p)
            rows.append(Completion(
                request_index=r, index=j, prompt_ids=ids, params=p, stop_ids=stop, context=plan.context,
                tokenizer=plan.tokenizer, seq_id=-1, generator=_seeded(p, j, device),
                matcher=new_matcher(plan.grammars[r], plan.eos) if plan.grammars[r] is not None else None,
            ))
    return rows, _loop(plan, runner, rows, device, generator)


def _loop(plan: _Plan, runner: Runner, rows: list[Completion], device: torch.device,
          generator: torch.Generator | None) -> Iterator[StreamEvent]:
    # inference_mode is entered per step, never across a yield: grad mode is thread-local state, and a
    # generator suspended inside the context would leave the consumer's own code in inference mode
    try:
        with torch.inference_mode():
            # prefill each prompt once; its other n - 1 completions fork the cache (prefix sharing)
            firsts = [c for c in rows if c.index == 0]
            for c in firsts:
                c.seq_id = runner.new_id()
            logits_req = runner.extend([c.seq_id for c in firsts], [c.prompt_ids for c in firsts])  # [R, V]
            for c in rows:
                if c.index:
                    c.seq_id = runner.fork(firsts[c.request_index].seq_id)
                c.model_steps = 1
            request_of_row = [c.request_index for c in rows]
            logits = logits_req if request_of_row == list(range(len(firsts))) else \
                logits_req.index_select(0, _device_index(request_of_row, device))
            active = rows
            state = SamplingState.for_prompts([c.prompt_ids for c in active], plan.vocab, device,
                                              [c.generator for c in active], generator)
            pipeline = _pipeline(plan, active)
            # plain greedy rows (no processor, no grammar, no log-probs) take their tokens from the graph
            # that computed the logits: no sampler launch from Python between two replays
            plain = _plain_greedy(pipeline, active)
            # [B, K] tokens a multi-step greedy replay chose (device), each row's last the next input
            chosen: torch.Tensor | None = None
            greedy_next: torch.Tensor | None = None
        while True:
            events: list[StreamEvent] = []
            with torch.inference_mode():
                if chosen is not None:
                    emitted, tokens = chosen, chosen[:, -1]
                else:
                    if greedy_next is not None:
                        tokens = greedy_next  # the graph's argmax of these logits, the greedy sampler's kernel
                    else:
                        processed = pipeline.process(logits, state)
                        tokens = pipeline.sample(processed, state)  # [B] on device
                        state.update(tokens)
                    emitted = tokens[:, None]
                lps = _token_logprobs(logits, tokens, active) if chosen is None else [None] * len(active)
                # Look ahead: queue the next forward before reading the tokens on the host, for every row
                # that can go on by length (whether a token is EOS or ends a stop string is known only
                # after the copy), so the GPU computes step N + 1 while the host handles step N. A row that
                # turns out finished wasted one row of that step; its sequence is evicted below.
                host_tokens = _to_host(emitted)
                inflight = emitted.shape[1]
                ahead_rows = [i for i, c in enumerate(active) if len(c.token_ids) + inflight < c.limit]
                ahead = ahead_greedy = ahead_chosen = None
                ahead_steps = 1
                if ahead_rows and runner.cache is not None and _looks_ahead(device):
                    ahead_tokens = tokens if len(ahead_rows) == len(active) else \
                        tokens.index_select(0, _device_index(ahead_rows, device))
                    ahead_ids = [active[i].seq_id for i in ahead_rows]
                    if plain:
                        # plain greedy: up to GREEDY_STEPS steps per replay, as many as every row may still take
                        budget = min(active[i].limit - len(active[i].token_ids) - inflight for i in ahead_rows)
                        ahead_steps = 1 << (min(budget, GREEDY_STEPS).bit_length() - 1)
                        if ahead_steps > 1:
                            ahead_chosen = runner.greedy_steps(ahead_ids, ahead_tokens, ahead_steps)
                        if ahead_chosen is None:
                            ahead_steps = 1
                    if ahead_chosen is None:
                        both = runner.greedy_step(ahead_ids, ahead_tokens) if plain else None
                        if both is not None:
                            ahead, ahead_greedy = both
                        else:
                            ahead = runner.step(ahead_ids, ahead_tokens)
                host = host_tokens()  # the step's one wait for the device
                keep: list[int] = []
                for i, c in enumerate(active):
                    event = c.add(host[i], lps[i])
                    if event is not None:
                        events.append(event)
                    if c.finished:
                        runner.release(c.seq_id)
                    else:
                        keep.append(i)
                if keep and len(keep) != len(active):
                    active = [active[i] for i in keep]
                    tokens = tokens.index_select(0, _device_index(keep, device))
                    state = state.select(keep)
                    pipeline = _pipeline(plan, active)
                chosen = greedy_next = None
                queued = ahead is not None or ahead_chosen is not None
                if queued and keep:
                    position = {row: j for j, row in enumerate(ahead_rows)}
                    picked = [position[i] for i in keep]  # every kept row was looked ahead (limit not reached)
                    every = len(picked) == len(ahead_rows)
                    index = None if every else _device_index(picked, device)
                    if ahead_chosen is not None:
                        chosen = ahead_chosen if index is None else ahead_chosen.index_select(0, index)
                    else:
                        logits = ahead if index is None else ahead.index_select(0, index)
                        if ahead_greedy is not None:
                            greedy_next = ahead_greedy if index is None else ahead_greedy.index_select(0, index)
            yield from events  # the next forward is already queued: a streaming client sees tokens at once
            if not keep:
                return
            if not queued:
                with torch.inference_mode():
                    logits = runner.step([c.seq_id for c in active], tokens)
            for c in active:
                c.model_steps += ahead_steps
    finally:
        runner.close()


def _pipeline(plan: _Plan, active: Sequence[Completion]) -> LogitsPipeline:
    matchers = [c.matcher for c in active]
    grammar = GrammarMask(matchers, plan.vocab) if any(m is not None for m in matchers) else None
    return LogitsPipeline([c.params for c in active], [sorted(c.stop_ids) for c in active], grammar)


def generate(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    tokenizer: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache: str | KVCache = "contiguous",
    use_cache: bool = True,
    draft_model: Any = None,
    num_speculative_tokens: int = 4,
    draft_cache: str | KVCache = "contiguous",
    generator: torch.Generator | None = None,
    cuda_graphs: bool | None = None,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 3,
) -> list[RequestOutput]:
    """Generate completions for a batch of prompts. The serve ABI: stable across minor versions.

    Args:
        model: a ``plyx.model.TransformerLM`` (anything with ``.config`` and its call signature).
        prompts: one prompt or a list; each a string (needs ``tokenizer``) or a list of token ids.
            Prompts may differ in length: they are prefilled left-padded and decoded ragged.
        params: one ``SamplingParams`` for all prompts, one per prompt, or None (the defaults:
            temperature 1, 16 new tokens).
        tokenizer: a ``tokenizers.Tokenizer`` or transformers tokenizer, for text prompts, decoded
            text, stop strings and structured output.
        eos_token_id: id(s) that end a completion; default: the tokenizer's EOS.
        cache: KV-cache kind (``contiguous``, ``paged`` or a plugin's) or a ``KVCache`` instance;
            generate allocates its own sequence ids in it and evicts them when done.
        use_cache: False recomputes the whole sequence at each step (reference path).
        draft_model: a smaller model with the same vocabulary: speculative decoding; or ``"ngram"``:
            prompt-lookup speculation, drafts copied from the sequence's own context (no extra model); or
            draft heads on the base (``plyx.model.MedusaHeads`` / ``EagleDraft``, or their saved directory).
        num_speculative_tokens: draft tokens proposed per verification step (k).
        draft_cache: the draft model's KV-cache kind or instance.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes ``draft_model="ngram"`` looks up, longest first.
        generator: random source of requests without a seed (default: torch's global RNG).
        cuda_graphs: replay the one-token decode step as CUDA graphs (``DecodeGraphs``). None (the
            default): on when the model is on a GPU and the cache is block-addressable (contiguous,
            paged); True insists (an error names why it cannot); False runs every step eagerly.
            With graphs, each layer's q/k/v and gate/up weights are restacked in place
            (``TransformerLM.pack_projections_``: same parameters and values) so a step runs one GEMV
            per group, and the cache and graphs of the call are kept for the next call of its shape.

    Returns:
        One ``RequestOutput`` per prompt, in order, each with ``n`` ``CompletionOutput``.

    Raises:
        ConfigError: before any compute, for an empty or too long prompt, a bad parameter, an invalid
            schema/regex/grammar, a missing tokenizer, an unknown plugin name or a draft model with
            another vocabulary.

    Example:
        >>> outs = generate(model, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=8))
        >>> outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason
    """
    stream = stream_generate(
        model, prompts, params, tokenizer=tokenizer, eos_token_id=eos_token_id, cache=cache, use_cache=use_cache,
        draft_model=draft_model, num_speculative_tokens=num_speculative_tokens, draft_cache=draft_cache,
        generator=generator, cuda_graphs=cuda_graphs, prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max,
    )
    for _ in stream:
        pass
    return stream.outputs()


def _outputs(plan: _Plan, rows: Sequence[Completion]) -> list[RequestOutput]:
    by_request: dict[int, list[Completion]] = {}
    for c in rows:
        by_request.setdefault(c.request_index, []).append(c)
    return [
        RequestOutput(
            request_index=r,
            prompt=plan.prompt_texts[r],
            prompt_token_ids=tuple(plan.prompt_ids[r]),
            outputs=tuple(c.output() for c in sorted(by_request[r], key=lambda c: c.index)),
        )
        for r in range(len(plan.prompt_ids))
    ]
