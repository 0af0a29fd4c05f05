"""The low-level decode loop ``generate`` ran before it became a client of the engine: kept private, as a reference.

Not a public decoder (``generate`` and ``stream_generate`` run on ``plyx.serve.engine.Engine``). It stays for:

- benchmarks that need the graph decode ceiling of one static batch beside the engine
  (``bench/serving.py --vs-generate``, ``bench/bench_generate.py --reference``, ``bench/profile_generate.py``):
  ``reference_generate`` is the number the engine is measured against;
- the paths the engine has no equivalent for yet, which ``generate`` routes here: ``use_cache=False`` (the
  recompute-everything reference), a caller's cache that is not a ``PagedKVCache`` or a plugin cache kind,
  and draft models (``draft_model=``: a model, ``"ngram"`` or draft heads).

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
from plyx.serve._generate import GenerationStream, Prompt, _Plan, _seeded
from plyx.serve._outputs import RequestOutput, StreamEvent, TokenLogprob
from plyx.serve._params import SamplingParams
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import SamplingState
from plyx.serve._runner import Runner, model_device
from plyx.serve._structured import GrammarMask, new_matcher
from plyx.specs.kvcache import KVCache

__all__ = ["GREEDY_STEPS", "reference_generate", "reference_stream"]


def reference_stream(
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
    plan: _Plan | None = None,
) -> GenerationStream:
    """``stream_generate`` through the reference loop (same arguments; ``plan``: already validated inputs)."""
    if plan is None:
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


def reference_generate(model: Any, prompts: Prompt | Sequence[Prompt],
                       params: SamplingParams | Sequence[SamplingParams] | None = None, **kwargs: Any
                       ) -> list[RequestOutput]:
    """``generate`` through the reference loop: one static batch, its own cache, CUDA graphs on a GPU.

    Args:
        model, prompts, params, kwargs: as ``plyx.serve.generate``.

    Returns:
        One ``RequestOutput`` per prompt, in order.
    """
    stream = reference_stream(model, prompts, params, **kwargs)
    for _ in stream:
        pass
    return stream.outputs()


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


