"""``generate()`` and ``stream_generate()``: offline batches as thin clients of the engine.

One decode path: a call validates its inputs, submits every prompt to a ``plyx.serve.engine.Engine``
(the guardrails' input rails run there, per prompt) and drains it; the engine's batching, CUDA graphs,
multi-step decode and prefix cache apply, and the outputs come back in prompt order as
``RequestOutput``. Engines are kept per model for the next call of the same shape (their graphs and
prefix cache with them; the prefix cache is dropped when the weights changed in place).

What the engine has no equivalent for yet (``use_cache=False``, a plugin cache kind or a non-paged cache
object, draft models) runs the private reference loop of ``plyx.serve._reference``.
"""

from __future__ import annotations

import collections
import uuid
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import torch
from plyx.serve._completion import Completion
from plyx.serve._outputs import RequestOutput, StreamEvent
from plyx.serve._params import SamplingParams
from plyx.serve._pipeline import check_plugin_names
from plyx.serve._runner import model_device
from plyx.serve._structured import compile_structured
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
    engine_config: Any = None,
) -> GenerationStream:
    """Decode ``prompts`` and yield each completion's new tokens as they are produced.

    Same arguments as ``generate``. Every input is validated, and the guardrails' input rails run, when
    this is called (before the first ``next``); the requests still running when the iterator is closed
    are aborted (their cache sequences evicted). On CUDA, plain greedy rows arrive in events of up to
    ``decode_steps`` (8) tokens: the engine runs that many steps per schedule.

    Example:
        >>> for event in stream_generate(model, ["Once"], SamplingParams(max_new_tokens=8), tokenizer=tok):
        ...     print(event.text, end="", flush=True)
    """
    plan = _Plan(model, prompts, params, tokenizer, eos_token_id)
    if not _engine_runs(cache, use_cache, draft_model):
        from plyx.serve._reference import reference_stream

        return reference_stream(model, prompts, params, tokenizer=tokenizer, eos_token_id=eos_token_id, cache=cache,
                                use_cache=use_cache, draft_model=draft_model,
                                num_speculative_tokens=num_speculative_tokens, draft_cache=draft_cache,
                                generator=generator, cuda_graphs=cuda_graphs, prompt_lookup_min=prompt_lookup_min,
                                prompt_lookup_max=prompt_lookup_max, plan=plan)
    engine = _engine_for(plan, model, cache, cuda_graphs, engine_config)
    try:
        return _submit(plan, engine, generator)
    except BaseException:
        engine.client_busy = False
        raise


# ---------------------------------------------------------------------------
# generate as a client of the engine: submit every request, drain, outputs in request order
# ---------------------------------------------------------------------------
#: most rows an engine built for ``generate`` runs at once (more requests wait in its queue, admitted as rows end)
MAX_ENGINE_BATCH = 256
#: engines kept for the next ``generate`` call of the same model and shape (their cache, graphs and prefix
#: cache), least recently used dropped first; bounded in all, since an engine holds its model (and pool) alive
KEPT_ENGINES = 4
# (id(model), shape key) -> (weak reference to the model, its weights' addresses and version, the engine)
_ENGINES: collections.OrderedDict[tuple[Any, ...], tuple[Any, tuple[Any, ...], Any]] = collections.OrderedDict()


def _kept(model: Any) -> list[Any]:
    """The engines kept for ``model`` (least recently used first)."""
    return [engine for (mid, _), (ref, _, engine) in _ENGINES.items() if mid == id(model) and ref() is model]


def _engine_runs(cache: Any, use_cache: bool, draft_model: Any) -> bool:
    """Whether the engine serves this call. The reference loop (``plyx.serve._reference``) serves what the engine
    has no equivalent for yet: no cache, a plugin cache kind or non-paged cache object, and draft models."""
    if not use_cache or draft_model is not None:
        return False
    if isinstance(cache, str):
        return cache in ("contiguous", "paged")  # an unknown kind gets the reference loop's clear error
    from plyx.attn import PagedKVCache

    if type(cache) is PagedKVCache:
        return True
    if isinstance(cache, KVCache):
        warnings.warn(f"generate(cache=<{type(cache).__name__}>): a caller's cache that is not a "
                      "plyx.attn.PagedKVCache runs the private reference loop, not the engine, and is deprecated; "
                      'pass cache="paged" (or a PagedKVCache)', DeprecationWarning, stacklevel=4)
    return False


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _weights(model: Any) -> tuple[tuple[int, ...], int]:
    """Where the parameters live and how often they were written in place (``Tensor._version``): a new address
    voids an engine's graphs; a new version only its prefix cache (the cached keys and values are stale)."""
    from plyx.serve._runner import _weight_addresses

    return _weight_addresses(model), sum(p._version for p in model.parameters())


def _engine_for(plan: _Plan, model: Any, cache: Any, cuda_graphs: bool | None, engine_config: Any) -> Any:
    """The engine of this call: a kept one of the same shape when its weights are where they were, else a new one.

    Sized to the call: ``max_batch_size`` covers every row (up to ``MAX_ENGINE_BATCH``), ``max_model_len`` the
    longest prompt + ``max_new_tokens`` (a power of two, capped by the model's context: calls of similar shapes
    share an engine). ``engine_config`` overrides all of it.
    """
    from plyx.serve.engine import Engine, EngineConfig

    device = model_device(model)
    if cuda_graphs and device.type != "cuda":
        raise ConfigError("cuda_graphs", f"CUDA graphs cannot run here: the model is on {device}, not a CUDA device",
                          value=True, fix="pass cuda_graphs=None (use them where possible) or False")
    user_cache = None if isinstance(cache, str) else cache
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise ConfigError("engine_config", "engine_config must be a plyx.serve.engine.EngineConfig",
                          value=type(engine_config).__name__, fix="pass EngineConfig(...) or None")
    if engine_config is None:
        rows = sum(p.n for p in plan.params)
        batch = min(_pow2(rows), MAX_ENGINE_BATCH)
        length = min(plan.context, _pow2(plan.longest()))
        per_seq = -(-length // 16)  # blocks of EngineConfig.block_size, its default (16)
        engine_config = EngineConfig(
            max_batch_size=batch, max_batch_tokens=max(2048, batch), max_model_len=length,
            num_blocks=batch * (per_seq + 1),  # every row at full length, plus one copy-on-write block each
            max_queue=1 << 30, prefix_caching=user_cache is None, cuda_graphs=cuda_graphs is not False,
            # an offline batch prefills once, then decodes: decode graphs pay off, while capturing a mixed-step
            # graph per token bucket (seconds at engine start) would not
            mixed_graphs=False)
    eos = tuple(plan.eos)
    training = bool(getattr(model, "training", False))  # the Engine puts its model in eval mode; generate never did
    if user_cache is not None:  # the caller's pool: an engine of its own, never kept
        engine = Engine(model, tokenizer=plan.tokenizer, config=engine_config, eos_token_id=eos, cache=user_cache)
        model.train(training)
        engine.client_busy = True
        return engine
    key = (id(model), (engine_config, id(plan.tokenizer.raw) if plan.tokenizer is not None else None, eos,
                       str(device)))
    weights = _weights(model)
    entry = _ENGINES.pop(key, None)
    if entry is not None:
        ref, (addresses, version), engine = entry
        if (ref() is model and addresses == weights[0] and not engine.client_busy
                and not engine.has_unfinished()):
            if version != weights[1] and engine.prefix is not None:
                engine.prefix.clear()  # the weights changed in place (a training step): cached prefixes are stale
            engine.tokenizer = plan.tokenizer
            engine.client_busy = True
            _ENGINES[key] = (ref, weights, engine)
            return engine
    engine = Engine(model, tokenizer=plan.tokenizer, config=engine_config, eos_token_id=eos)
    model.train(training)  # a model being trained (on-policy distillation samples with generate) stays so
    engine.client_busy = True
    # read after the build: CUDA graphs restack the q/k/v and gate/up weights in place (new addresses, once)
    _ENGINES[key] = (weakref.ref(model), _weights(model), engine)
    while len(_ENGINES) > KEPT_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def _submit(plan: _Plan, engine: Any, generator: torch.Generator | None) -> GenerationStream:
    """Queue every prompt (input rails first: a refusal raises before anything runs) and return the stream that
    drains the engine."""
    if generator is None and any(p.seed is None and not p.greedy for p in plan.params):
        # unseeded sampling draws from torch's global RNG, as it always did: torch.manual_seed makes a call repeat
        seed = int(torch.randint(0, 2**62, (), generator=None).item())
        generator = torch.Generator(device=engine.device).manual_seed(seed)
    if generator is not None:
        engine.generator = generator

    def add(rid: str, r: int, ids: list[int], guard: Any) -> Any:
        req = engine.add_request(rid, ids, plan.params[r], grammar=plan.grammars[r], guard=guard)
        for seq in req.seqs:
            seq.completion.request_index = r  # events name the prompt, not the engine's request
        return req

    requests = _submit_each(engine, plan, "generate", add)
    return GenerationStream(plan, [s.completion for req in requests for s in req.seqs], _drain(engine, requests),
                            requests=requests)


def _submit_each(engine: Any, plan: _Plan, endpoint: str, add: Any) -> list[Any]:
    """One engine request per prompt, ``add(request_id, r, ids, guard)`` after the prompt's input guardrails (an
    input rail's rewrite is encoded again); any error aborts the requests added so far and propagates.
    Shared by ``generate`` and ``beam_search`` (``endpoint``: the name the guardrails see)."""
    base = f"{endpoint}-{uuid.uuid4().hex[:12]}-"
    requests: list[Any] = []
    try:
        for r, ids in enumerate(plan.prompt_ids):
            rid = f"{base}{r}"
            guard = None
            if engine.config.guardrails:
                guard = engine.guard_for(rid, ids, plan.prompt_texts[r], endpoint=endpoint)
                guard.admit()  # raises RequestRefused (reported to plyx_on_response first)
                if guard.rewritten is not None:  # an input rail redacted the prompt: the model sees the new text
                    ids = _rewritten_ids(plan, r, guard.rewritten)
            requests.append(add(rid, r, ids, guard))
    except BaseException:
        for req in requests:
            engine.abort(req.request_id)
        raise
    return requests


def _rewritten_ids(plan: _Plan, r: int, text: str) -> list[int]:
    if plan.tokenizer is None:
        raise ConfigError(f"prompts[{r}]", "a guardrail rewrote the prompt and there is no tokenizer to encode it",
                          fix="pass tokenizer=... to generate()")
    ids = plan.tokenizer.encode(text)
    if not ids or len(ids) >= plan.context:
        raise ConfigError(f"prompts[{r}]", f"the guardrail's rewrite of the prompt has {len(ids)} tokens; it must "
                          f"have 1 to {plan.context - 1}", value=len(ids), fix="shorten the prompt")
    plan.prompt_ids[r] = ids
    plan.prompt_texts[r] = text if plan.prompt_texts[r] is not None else None
    return ids


def _drain(engine: Any, requests: list[Any]) -> Iterator[StreamEvent]:
    """Step the engine until every request ended; each step's events, in step order. Closing the iterator
    aborts what still runs (its blocks freed) and hands the engine back for the next call."""
    try:
        while any(not r.finished for r in requests):
            for out in engine.step():  # inference mode is entered per step, never across a yield
                if out.event is not None:
                    yield out.event
    finally:
        for r in requests:
            if not r.finished:
                engine.abort(r.request_id)
        engine.client_busy = False


class GenerationStream:
    """The iterator ``stream_generate`` returns: ``StreamEvent``s, then ``outputs()`` once exhausted."""

    def __init__(self, plan: _Plan, rows: list[Completion], events: Iterator[StreamEvent], *,
                 requests: Sequence[Any] = ()) -> None:
        self._plan = plan
        self._rows = rows
        self._events = events
        self._requests = requests  # the engine's requests (their guards' filtered text), in prompt order

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamEvent:
        return next(self._events)

    def close(self) -> None:
        """Stop early; the requests still running are aborted (their cache sequences evicted)."""
        self._events.close()  # type: ignore[attr-defined]

    def outputs(self) -> list[RequestOutput]:
        """The ``RequestOutput`` of every prompt so far (complete once the iterator is exhausted)."""
        outs = _outputs(self._plan, self._rows)
        if not self._requests:
            return outs
        return [_guarded(o, req) for o, req in zip(outs, self._requests)]


def _guarded(out: RequestOutput, req: Any) -> RequestOutput:
    """The output with each completion's text as the request's output filters let it out."""
    guard = getattr(req, "guard", None)
    if guard is None or not guard.filtering:
        return out
    return msgspec.structs.replace(out, outputs=tuple(
        msgspec.structs.replace(c, text=guard.text(req.request_id, c.index)) if c.text is not None else c
        for c in out.outputs))


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
    engine_config: Any = None,
) -> list[RequestOutput]:
    """Generate completions for a batch of prompts. The serve ABI: stable across minor versions.

    A client of the engine (``plyx.serve.engine.Engine``): every prompt is submitted, the engine is drained,
    and the outputs come back in prompt order. The guardrails (``plyx_on_request_received``,
    ``plyx_output_filters``, ``plyx_on_response``: plyx-safety's when a policy is active) run on every
    prompt exactly as they do behind the HTTP server.

    Args:
        model: a ``plyx.model.TransformerLM`` (anything with ``.config`` and its call signature).
        prompts: one prompt or a list; each a string (needs ``tokenizer``) or a list of token ids.
            Prompts may differ in length: they are prefilled left-padded and decoded ragged.
        params: one ``SamplingParams`` for all prompts, one per prompt, or None (the defaults:
            temperature 1, 16 new tokens).
        tokenizer: a ``tokenizers.Tokenizer`` or transformers tokenizer, for text prompts, decoded
            text, stop strings and structured output.
        eos_token_id: id(s) that end a completion; default: the tokenizer's EOS.
        cache: KV-cache kind or a ``KVCache`` instance. ``contiguous`` (the default) and ``paged`` run the
            engine on its paged pool (sized to the call); a ``plyx.attn.PagedKVCache`` instance runs the
            engine in that pool (sequences already in it are left alone; the call's sequences are evicted when
            done; no prefix cache). A plugin's kind runs the reference loop; another ``KVCache`` instance too
            (deprecated: pass a kind or a ``PagedKVCache``).
        use_cache: False recomputes the whole sequence at each step (the reference loop).
        draft_model: a smaller model with the same vocabulary: speculative decoding; or ``"ngram"``:
            prompt-lookup speculation, drafts copied from the sequence's own context (no extra model); or
            draft heads on the base (``plyx.model.MedusaHeads`` / ``EagleDraft``, or their saved directory).
            Speculative calls run the reference loop (the engine's own speculation is
            ``EngineConfig.speculative_ngram``).
        num_speculative_tokens: draft tokens proposed per verification step (k).
        draft_cache: the draft model's KV-cache kind or instance.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes ``draft_model="ngram"`` looks up, longest first.
        generator: random source of requests without a seed (default: torch's global RNG).
        cuda_graphs: replay the engine's steps as CUDA graphs (``EngineConfig.cuda_graphs`` and
            ``mixed_graphs``). None (the default): on when the model is on a GPU; True insists (an error
            names why it cannot); False runs every step eagerly. The engine of a call (its cache, graphs
            and prefix cache) is kept for the next call of its shape.
        engine_config: an ``EngineConfig`` for the call's engine (batch size, token budget, prefix caching,
            multi-step decode, ...); None sizes one to the call (every row at once, up to 256).

    Returns:
        One ``RequestOutput`` per prompt, in order, each with ``n`` ``CompletionOutput``.

    Raises:
        ConfigError: before any compute, for an empty or too long prompt, a bad parameter, an invalid
            schema/regex/grammar, a missing tokenizer, an unknown plugin name or a draft model with
            another vocabulary.
        RequestRefused: (``plyx.serve.engine.RequestRefused``) an input rail refused a prompt; nothing ran.

    Example:
        >>> outs = generate(model, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=8))
        >>> outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason
    """
    stream = stream_generate(
        model, prompts, params, tokenizer=tokenizer, eos_token_id=eos_token_id, cache=cache, use_cache=use_cache,
        draft_model=draft_model, num_speculative_tokens=num_speculative_tokens, draft_cache=draft_cache,
        generator=generator, cuda_graphs=cuda_graphs, prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max, engine_config=engine_config,
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
