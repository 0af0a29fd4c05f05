"""``beam_search()``: transformers' beam search, as a client of the engine.

One decode path: the prompts are submitted to a ``plyx.serve.engine.Engine`` as ``BeamSearchParams`` requests
(each a group of ``num_beams`` rows sharing the prompt's paged blocks through ``fork``; the search itself is
``plyx.serve.engine._beam_group``) and the engine is drained; its batching, prefix cache and preemption apply, and
the guardrails run on every prompt as for ``generate``.

What the engine has no equivalent for (``use_cache=False``, a plugin cache kind or a cache object that is not a
``plyx.attn.PagedKVCache``) runs the reference loop below (``_search``), transformers' vectorised beam search on
any KV cache through ``fork``/``evict``. Per step and prompt (P prompts, N beams, K = max(2, 1 + #stop ids) * N
candidates):

1. ``acc[b, v] = running_score[b] + log_softmax(logits[b])[v]`` over the N beams; keep the top K of
   the N * V continuations (K > N so that N non-finished beams always remain);
2. candidates ending in a stop id (or reaching max_new_tokens) among the top N are offered to the
   finished set with score ``acc / generated_len ** length_penalty``; the finished set keeps its N best;
3. the N best non-finished candidates become the running beams: beam j continues from parent beam
   ``p_j``, so its cache sequence is the parent's (kept, or ``KVCache.fork``-ed when two children
   share a parent; prefix sharing on a paged cache) and unused parents are evicted;
4. stop when no running beam can beat the worst finished one (``early_stopping``; transformers'
   heuristic), or every candidate hit a stop.

Both mirror ``GenerationMixin._beam_search`` step for step, so the tests compare token ids and
scores with transformers on the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from plyx.serve._outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from plyx.serve._params import BeamSearchParams, SamplingParams
from plyx.serve._runner import Runner, model_device
from plyx.specs.kvcache import KVCache

__all__ = ["beam_search"]

_NEG = -1.0e9  # transformers' "impossible" score


def beam_search(
    model: Any,
    prompts: Any,
    params: BeamSearchParams | None = None,
    *,
    tokenizer: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache: str | KVCache = "contiguous",
    use_cache: bool = True,
) -> list[RequestOutput]:
    """Beam-search completions for a batch of prompts (deterministic; no sampling).

    Args:
        model, prompts, tokenizer, eos_token_id, cache, use_cache: as for ``generate`` (``contiguous`` and
            ``paged`` run the engine on its paged pool, a ``PagedKVCache`` runs the engine in that pool).
        params: a ``BeamSearchParams`` (default: 4 beams, 16 new tokens).

    Returns:
        One ``RequestOutput`` per prompt whose ``outputs`` are the ``num_return_sequences`` best
        finished hypotheses, best first, each with its length-penalised ``score``.

    Raises:
        ConfigError: a bad prompt or parameter, before any compute.
        RequestRefused: an input rail refused a prompt; nothing ran.

    Example:
        >>> out = beam_search(model, [[1, 2, 3]], BeamSearchParams(num_beams=4, max_new_tokens=8))
        >>> out[0].outputs[0].token_ids, out[0].outputs[0].score
    """
    from plyx.serve._generate import _engine_runs, _Plan
    from plyx.specs.errors import ConfigError

    params = params or BeamSearchParams()
    if not isinstance(params, BeamSearchParams):
        raise ConfigError("params", "beam_search takes a BeamSearchParams", value=type(params).__name__,
                          fix="pass BeamSearchParams(num_beams=..., max_new_tokens=...)")
    # validation as generate's (empty, too long or out-of-vocabulary prompts), with the rows the beams take
    plan = _Plan(model, prompts, SamplingParams(n=params.num_beams, temperature=0.0,
                                                max_new_tokens=params.max_new_tokens), tokenizer, eos_token_id)
    if not _engine_runs(cache, use_cache, None):
        return _reference(model, plan, params, cache if use_cache else None)
    return _engine_beams(model, plan, params, cache)


def _engine_beams(model: Any, plan: Any, params: BeamSearchParams, cache: Any) -> list[RequestOutput]:
    """Submit every prompt to the call's engine as a beam request, drain it, outputs in prompt order."""
    from plyx.serve._generate import _drain, _engine_for, _submit_each

    engine = _engine_for(plan, model, cache, None, None)
    try:
        requests = _submit_each(engine, plan, "beam_search",
                                lambda rid, r, ids, guard: engine.add_request(rid, ids, params, guard=guard))
    except BaseException:
        engine.client_busy = False
        raise
    for _ in _drain(engine, requests):  # closes (aborting what still runs) on an exception
        pass
    return [msgspec.structs.replace(engine.request_output(req, r), prompt=plan.prompt_texts[r])
            for r, req in enumerate(requests)]


def _reference(model: Any, plan: Any, params: BeamSearchParams, cache: Any) -> list[RequestOutput]:
    """The reference loop (``_search``) on a ``Runner``: no cache, a plugin kind or a non-paged cache object."""
    tok, prompt_ids, prompt_texts = plan.tokenizer, plan.prompt_ids, plan.prompt_texts
    context = plan.context
    stops = list(plan.eos)
    stops += [t for t in params.stop_token_ids if t not in stops]
    nb = params.num_beams
    longest = min(context, max(len(ids) for ids in prompt_ids) + params.max_new_tokens)
    runner = Runner(model, cache, num_sequences=2 * nb * len(prompt_ids), max_seq_len=longest)
    try:
        with torch.inference_mode():
            seqs, scores, lens, lps, steps = _search(runner, prompt_ids, params, stops, context)
    finally:
        runner.close()
    outputs = []
    for p, ids in enumerate(prompt_ids):
        comps = []
        for rank in range(params.num_return_sequences):
            n = lens[p][rank]
            toks = tuple(seqs[p][rank][:n])
            stop_reason = toks[-1] if toks and toks[-1] in stops else None
            comps.append(CompletionOutput(
                index=rank,
                token_ids=toks,
                text=tok.decode(toks) if tok is not None else None,
                finish_reason="stop" if stop_reason is not None else "length",
                stop_reason=stop_reason,
                logprobs=tuple(TokenLogprob(t, lp) for t, lp in zip(toks, lps[p][rank][:n])) if params.logprobs else None,
                cumulative_logprob=float(sum(lps[p][rank][:n])),
                score=float(scores[p][rank]),
                metrics=RequestMetrics(num_generated=n, model_steps=steps),
            ))
        outputs.append(RequestOutput(request_index=p, prompt=prompt_texts[p], prompt_token_ids=tuple(ids),
                                     outputs=tuple(comps)))
    return outputs


def _search(runner: Runner, prompt_ids: list[list[int]], params: BeamSearchParams, stops: list[int],
            context: int) -> tuple[list[Any], list[Any], list[Any], list[Any], int]:
    device = model_device(runner.model)
    P, nb = len(prompt_ids), params.num_beams
    K = max(2, 1 + len(stops)) * nb
    limit = torch.tensor([min(params.max_new_tokens, context - len(ids)) for ids in prompt_ids], device=device)
    M = int(limit.max())
    stop_t = torch.tensor(stops, dtype=torch.long, device=device)
    top_nb = torch.arange(K, device=device) < nb  # [K]
    es, lp_exp = params.early_stopping, params.length_penalty

    running = torch.zeros(P, nb, M, dtype=torch.long, device=device)  # generated tokens of running beams
    running_lp = torch.zeros(P, nb, M, device=device)  # each token's raw log-prob
    running_scores = torch.zeros(P, nb, device=device)
    running_scores[:, 1:] = _NEG  # all beams start equal: only beam 0 may expand at step 0
    fin = running.clone()
    fin_lp = running_lp.clone()
    fin_scores = torch.full((P, nb), _NEG, device=device)
    fin_len = torch.zeros(P, nb, dtype=torch.long, device=device)
    fin_done = torch.zeros(P, nb, dtype=torch.bool, device=device)
    unsat = torch.ones(P, 1, dtype=torch.bool, device=device)  # "a running beam may still improve"

    # prefill each prompt once, then fork it into its N beams
    roots = [runner.new_id() for _ in range(P)]
    logits = runner.extend(roots, prompt_ids)  # [P, V]
    beam_ids = [[roots[p]] + [runner.fork(roots[p]) for _ in range(nb - 1)] for p in range(P)]
    logits = logits.repeat_interleave(nb, dim=0)  # [P * N, V]
    V = logits.shape[-1]
    step = 0
    steps = 1
    while True:
        logp = logits.float().log_softmax(dim=-1).view(P, nb, V)
        acc = (logp + running_scores[:, :, None]).reshape(P, nb * V)
        topk_lp, topk_idx = acc.topk(K, dim=-1)  # [P, K]
        parent = topk_idx // V
        token = topk_idx % V
        cand = running.gather(1, parent[:, :, None].expand(P, K, M)).clone()
        cand[:, :, step] = token
        cand_lp = running_lp.gather(1, parent[:, :, None].expand(P, K, M)).clone()
        cand_lp[:, :, step] = logp.reshape(P, nb * V).gather(1, topk_idx)
        hits = torch.isin(token, stop_t) | (step + 1 >= limit)[:, None]  # [P, K]

        # running beams for the next step: the N best candidates that did not stop
        run_lp = topk_lp + hits.float() * _NEG
        nxt = run_lp.topk(nb, dim=-1).indices  # [P, N]
        running = cand.gather(1, nxt[:, :, None].expand(P, nb, M))
        running_lp = cand_lp.gather(1, nxt[:, :, None].expand(P, nb, M))
        running_scores = run_lp.gather(1, nxt)
        new_parent = parent.gather(1, nxt)

        # finished hypotheses: the top-N candidates that stopped, length-penalised
        just = hits & top_nb[None, :]
        scored = topk_lp / float(step + 1) ** lp_exp
        if es is True:
            scored = scored + (fin_done.all(dim=-1, keepdim=True)).float() * _NEG
        scored = scored + (~unsat).float() * _NEG + (~just).float() * _NEG
        m_scores = torch.cat([fin_scores, scored], dim=1)
        pick = m_scores.topk(nb, dim=-1).indices
        fin = torch.cat([fin, cand], dim=1).gather(1, pick[:, :, None].expand(P, nb, M))
        fin_lp = torch.cat([fin_lp, cand_lp], dim=1).gather(1, pick[:, :, None].expand(P, nb, M))
        fin_scores = m_scores.gather(1, pick)
        fin_len = torch.cat([fin_len, torch.full_like(token, step + 1)], dim=1).gather(1, pick)
        fin_done = torch.cat([fin_done, just], dim=1).gather(1, pick)

        step += 1
        # transformers' early-stop heuristic
        if es == "never" and lp_exp > 0.0:
            best_len = limit[:, None].float()
        else:
            best_len = torch.full((P, 1), float(step), device=device)
        best_running = running_scores[:, :1] / best_len ** lp_exp
        worst_fin = torch.where(fin_done, fin_scores.min(dim=1, keepdim=True).values, torch.full_like(fin_scores, _NEG))
        unsat = unsat & (best_running > worst_fin).any(dim=-1, keepdim=True)
        open_beams = not (bool(fin_done.all()) and es is True)
        if not (bool(unsat.any()) and open_beams and not bool(hits.all())):
            break

        # the cache follows the beams: keep, fork or evict each parent's sequence
        parents = new_parent.tolist()
        last = running[:, :, step - 1].reshape(-1)  # [P * N] tokens to feed
        new_ids: list[list[int]] = []
        for p in range(P):
            kept: set[int] = set()
            row = []
            for par in parents[p]:
                sid = beam_ids[p][par]
                row.append(sid if par not in kept else runner.fork(sid))
                kept.add(par)
            for j, sid in enumerate(beam_ids[p]):
                if j not in kept:
                    runner.release(sid)
            new_ids.append(row)
        beam_ids = new_ids
        logits = runner.step([sid for row in beam_ids for sid in row], last)
        steps += 1
    return fin.tolist(), fin_scores.tolist(), fin_len.tolist(), fin_lp.tolist(), steps
