"""Beam search inside the engine: a request of ``BeamSearchParams`` runs as a group of ``num_beams`` sequences.

The group's sequences are ordinary engine rows (scheduled, batched and preempted like any other, in the same
packed step as sampled requests); only their "sampling" differs. When every live beam of a group has its next
logits (a step computed them, or an earlier one did and they wait in ``Engine._ahead`` for the others: a beam
preempted by recompute comes back later), the group takes one step of transformers' vectorised beam search
(``GenerationMixin._beam_search``):

1. ``acc[b, v] = running_score[b] + log_softmax(logits[b])[v]`` over the N beams; the top K = max(2, 1 + #stop
   ids) * N of the N * V continuations;
2. the top-N candidates that end in a stop id (or reach the length limit) are offered to the finished set with
   score ``sum_logprobs / generated_len ** length_penalty``; the finished set keeps its N best;
3. the N best candidates that did not stop become the beams: beam j continues parent ``p_j``'s cache: the first
   child of a parent takes the parent's cache sequence, every further child a ``PagedKVCache.fork`` of it (its
   blocks shared, copy-on-write when written), and parents without children are evicted;
4. the group ends when no beam can beat the worst finished hypothesis (``early_stopping``, transformers'
   heuristic) or every candidate stopped; the ``num_return_sequences`` best come out, one event each.

At the first step (the prompt just prefilled by beam 0) the other beams are followers without cache entries:
every candidate then comes from beam 0 (transformers starts beams 1..N-1 at -1e9), so they fork beam 0's prompt.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from plyx.serve._completion import Completion
from plyx.serve._outputs import CompletionOutput, RequestMetrics, StreamEvent, TokenLogprob
from plyx.serve._params import BeamSearchParams, SamplingParams
from plyx.serve.engine._sequence import EngineRequest, SeqStatus, Sequence
from plyx.specs.errors import ConfigError

if TYPE_CHECKING:
    from plyx.serve.engine._engine import Engine, EngineOutput

__all__ = ["BeamGroup", "beam_rows_params", "check_beam_request", "step_beams"]

_NEG = -1.0e9  # transformers' "impossible" score


def beam_rows_params(params: BeamSearchParams) -> SamplingParams:
    """The ``SamplingParams`` the group's rows carry (the scheduler and the row checks read them): greedy, one row
    per beam, the beam's length and stop ids. No row of a group is ever sampled with them."""
    return SamplingParams(n=params.num_beams, temperature=0.0, max_new_tokens=params.max_new_tokens,
                          stop_token_ids=params.stop_token_ids)


def check_beam_request(engine: Engine, prompt_ids: Any, params: BeamSearchParams, adapter: str | None) -> None:
    """Raise ``ConfigError`` for a beam request the engine cannot run: more beams than rows, a prompt that
    leaves no room for a token, or a engine without a forkable cache."""
    if params.num_beams > engine.config.max_batch_size:
        raise ConfigError("BeamSearchParams.num_beams", f"{params.num_beams} beams run as {params.num_beams} rows of "
                          f"one batch, and the engine runs at most max_batch_size={engine.config.max_batch_size}",
                          value=params.num_beams, fix="use fewer beams or raise EngineConfig.max_batch_size")
    if len(prompt_ids) >= engine.max_model_len:
        raise ConfigError("prompt", f"the prompt has {len(prompt_ids)} tokens and the context is "
                          f"{engine.max_model_len}: no room for a beam's first token", value=len(prompt_ids),
                          fix=f"shorten the prompt to at most {engine.max_model_len - 1} tokens")
    if adapter is not None:
        raise ConfigError("adapter", "beam search runs on the base model", value=adapter,
                          fix="leave the adapter out of a beam request")


class BeamGroup:
    """The search state of one beam request (transformers' tensors for one prompt, ``P = 1``).

    Args:
        engine: the engine that runs the rows. req: the request (its ``seqs`` are the beams, index order).
        params: the request's ``BeamSearchParams``. stops: the ids that end a hypothesis.
    """

    def __init__(self, engine: Engine, req: EngineRequest, params: BeamSearchParams, stops: list[int]) -> None:
        device = engine.device
        self.req = req
        self.params = params
        self.stops = stops
        nb = params.num_beams
        self.K = max(2, 1 + len(stops)) * nb  # > N candidates: N beams that did not stop always remain
        self.limit = min(params.max_new_tokens, engine.max_model_len - len(req.prompt_ids))
        M = self.limit
        self.stop_t = torch.tensor(stops, dtype=torch.long, device=device)
        self.top_nb = torch.arange(self.K, device=device) < nb  # [K]
        self.running = torch.zeros(1, nb, M, dtype=torch.long, device=device)  # generated tokens of the beams
        self.running_lp = torch.zeros(1, nb, M, device=device)  # each token's raw log-prob
        self.running_scores = torch.zeros(1, nb, device=device)
        self.running_scores[:, 1:] = _NEG  # all beams start equal: only beam 0 may expand at the first step
        self.fin = self.running.clone()
        self.fin_lp = self.running_lp.clone()
        self.fin_scores = torch.full((1, nb), _NEG, device=device)
        self.fin_len = torch.zeros(1, nb, dtype=torch.long, device=device)
        self.fin_done = torch.zeros(1, nb, dtype=torch.bool, device=device)
        self.unsat = torch.ones(1, 1, dtype=torch.bool, device=device)  # "a beam may still improve"
        self.step = 0
        self.rows: dict[int, torch.Tensor] = {}  # beam index -> its next logits [V], gathered over steps

    @property
    def live(self) -> list[Sequence]:
        """The beams that expand at this step: beam 0 at the first (the others follow it), then all."""
        return self.req.seqs[:1] if self.step == 0 else self.req.seqs

    def ready(self) -> bool:
        return all(s.index in self.rows for s in self.live)

    # -- one step of the search --------------------------------------------------------------
    def expand(self, engine: Engine) -> list[EngineOutput]:
        """One beam-search step over the gathered logits; the cache follows the new beams. The group's final
        outputs when it ended, else none."""
        nb, K, M, step = self.params.num_beams, self.K, self.limit, self.step
        if step == 0:
            logits = self.rows.pop(0)[None].expand(nb, -1)  # [N, V]: every beam starts from the prompt
        else:
            logits = torch.stack([self.rows.pop(j) for j in range(nb)])  # [N, V]
        V = logits.shape[-1]
        logp = logits.float().log_softmax(dim=-1).view(1, nb, V)
        acc = (logp + self.running_scores[:, :, None]).reshape(1, nb * V)
        topk_lp, topk_idx = acc.topk(K, dim=-1)  # [1, K]
        parent = topk_idx // V
        token = topk_idx % V
        cand = self.running.gather(1, parent[:, :, None].expand(1, K, M)).clone()  # [1, K, M]
        cand[:, :, step] = token
        cand_lp = self.running_lp.gather(1, parent[:, :, None].expand(1, K, M)).clone()
        cand_lp[:, :, step] = logp.reshape(1, nb * V).gather(1, topk_idx)
        hits = torch.isin(token, self.stop_t) | (step + 1 >= M)  # [1, K]

        # the beams of the next step: the N best candidates that did not stop
        run_lp = topk_lp + hits.float() * _NEG
        nxt = run_lp.topk(nb, dim=-1).indices  # [1, N]
        self.running = cand.gather(1, nxt[:, :, None].expand(1, nb, M))
        self.running_lp = cand_lp.gather(1, nxt[:, :, None].expand(1, nb, M))
        self.running_scores = run_lp.gather(1, nxt)
        new_parent = parent.gather(1, nxt)  # [1, N]

        # finished hypotheses: the top-N candidates that stopped, length-penalised
        es, lp_exp = self.params.early_stopping, self.params.length_penalty
        just = hits & self.top_nb[None, :]
        scored = topk_lp / float(step + 1) ** lp_exp
        if es is True:
            scored = scored + self.fin_done.all(dim=-1, keepdim=True).float() * _NEG
        scored = scored + (~self.unsat).float() * _NEG + (~just).float() * _NEG
        m_scores = torch.cat([self.fin_scores, scored], dim=1)  # [1, N + K]
        pick = m_scores.topk(nb, dim=-1).indices
        self.fin = torch.cat([self.fin, cand], dim=1).gather(1, pick[:, :, None].expand(1, nb, M))
        self.fin_lp = torch.cat([self.fin_lp, cand_lp], dim=1).gather(1, pick[:, :, None].expand(1, nb, M))
        self.fin_scores = m_scores.gather(1, pick)
        self.fin_len = torch.cat([self.fin_len, torch.full_like(token, step + 1)], dim=1).gather(1, pick)
        self.fin_done = torch.cat([self.fin_done, just], dim=1).gather(1, pick)

        self.step = step = step + 1
        engine.stats.generated_tokens += nb
        # transformers' early-stop heuristic
        if es == "never" and lp_exp > 0.0:
            best_len = torch.full((1, 1), float(M), device=logits.device)
        else:
            best_len = torch.full((1, 1), float(step), device=logits.device)
        best_running = self.running_scores[:, :1] / best_len ** lp_exp
        worst_fin = torch.where(self.fin_done, self.fin_scores.min(dim=1, keepdim=True).values,
                                torch.full_like(self.fin_scores, _NEG))
        self.unsat = self.unsat & (best_running > worst_fin).any(dim=-1, keepdim=True)
        # the step's one host sync: the stop flags, each beam's parent and new token
        flags = torch.stack([self.unsat.any(), self.fin_done.all(), hits.all()]).long()  # [3]
        host = torch.cat([flags, new_parent[0], self.running[0, :, step - 1]]).tolist()  # [3 + 2N]
        unsat, all_done, all_hit = host[:3]
        if not (unsat and not (all_done and es is True) and not all_hit):
            return self._finish(engine)
        self._follow(engine, host[3:3 + nb], host[3 + nb:])
        return []

    def _follow(self, engine: Engine, parents: list[int], tokens: list[int]) -> None:
        """Beam j continues parent ``parents[j]`` with ``tokens[j]``: the first child of a parent takes its cache
        sequence, further children fork it (blocks shared, copy-on-write), childless parents are evicted."""
        seqs = self.req.seqs
        if self.step == 1:  # the first step: every beam continues the prompt, the only cache entry (beam 0's)
            parents = [0] * len(parents)
        old_ids = [s.seq_id for s in seqs]
        computed = seqs[0].num_computed  # every live beam holds the prompt and the same number of tokens
        histories = [list(seqs[p].tokens) for p in parents]
        taken: set[int] = set()
        order = engine._priority[old_ids[0]][0]
        new_ids = []
        for p in parents:
            if p not in taken:
                taken.add(p)
                new_ids.append(old_ids[p])
            else:
                sid = next(engine._seq_ids)
                engine.cache.fork(old_ids[p], sid)
                new_ids.append(sid)
        for p, sid in enumerate(old_ids):
            if p not in taken and seqs[p].status is not SeqStatus.FOLLOWER:  # a follower holds no entry yet
                engine.cache.evict(sid)
            if sid not in new_ids:
                engine._priority.pop(sid, None)
        head = seqs[0]
        for j, (seq, sid) in enumerate(zip(seqs, new_ids)):
            seq.seq_id = sid
            engine._priority[sid] = (order, j)
            seq.tokens = histories[j] + [tokens[j]]
            seq.num_computed = computed
            seq.completion.model_steps = self.step
            if seq.status is SeqStatus.FOLLOWER:  # the first step: it joins the batch on beam 0's prompt
                seq.prefix_node, seq.prefix_depth = head.prefix_node, head.prefix_depth
                seq.status = SeqStatus.RUNNING
                engine.running.append(seq)

    def _finish(self, engine: Engine) -> list[EngineOutput]:
        """Free every beam; the ``num_return_sequences`` best hypotheses, best first, as the request's outputs."""
        from plyx.serve.engine._engine import EngineOutput

        req = self.req
        for seq in req.seqs:
            engine._free(seq)
            seq.status = SeqStatus.FINISHED
            engine._priority.pop(seq.seq_id, None)
        nret = self.params.num_return_sequences
        toks_all = self.fin[0, :nret].tolist()
        lps_all = self.fin_lp[0, :nret].tolist()
        scores = self.fin_scores[0, :nret].tolist()
        lens = self.fin_len[0, :nret].tolist()
        head = req.seqs[0].completion
        results, events = [], []
        for rank in range(nret):
            n = lens[rank]
            toks, lps = toks_all[rank][:n], lps_all[rank][:n]
            text = Completion(request_index=head.request_index, index=rank, prompt_ids=req.prompt_ids,
                              params=req.params, stop_ids=self.stops, context=engine.max_model_len,
                              tokenizer=engine.tokenizer, seq_id=-1, generator=None)
            event = text.add(toks)
            logprobs = tuple(TokenLogprob(t, lp) for t, lp in zip(toks, lps)) if self.params.logprobs else None
            out = CompletionOutput(
                index=rank, token_ids=tuple(toks), text=text.output().text, finish_reason=text.output().finish_reason,
                stop_reason=text.stop_reason, logprobs=logprobs, cumulative_logprob=float(sum(lps)),
                score=float(scores[rank]), metrics=RequestMetrics(num_generated=n, model_steps=self.step))
            results.append(out)
            assert event is not None  # a hypothesis holds at least one token
            events.append(StreamEvent(request_index=head.request_index, index=rank, token_ids=out.token_ids,
                                      text=event.text, logprobs=logprobs, finish_reason=out.finish_reason,
                                      stop_reason=out.stop_reason))
        req.beam_outputs = tuple(results)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.finish_time = time.monotonic()
        engine.requests.pop(req.request_id, None)
        engine.beam_groups.pop(req.request_id, None)
        engine.stats.requests_finished += 1
        return [EngineOutput(req.request_id, ev.index, ev, request_finished=i == nret - 1)
                for i, ev in enumerate(events)]


def step_beams(engine: Engine, finishing: list[Sequence], rows: list[torch.Tensor]
               ) -> tuple[list[Sequence], list[torch.Tensor], list[EngineOutput]]:
    """Take the beam rows out of a step's rows that reached their end: each group expands once all its live
    beams have logits; a beam whose siblings are not there yet keeps its logits in ``engine._ahead`` (it is
    computed: the next steps schedule it with no token and hand them back).

    Returns:
        The other rows (they sample as usual), their logits, and the outputs of the groups that ended.
    """
    rest, rest_rows, touched = [], [], []
    for seq, row in zip(finishing, rows):
        group = engine.beam_groups.get(seq.request.request_id)
        if group is None:
            rest.append(seq)
            rest_rows.append(row)
            continue
        group.rows[seq.index] = row
        if group not in touched:
            touched.append(group)
    outputs: list[EngineOutput] = []
    for group in touched:
        if group.ready():
            outputs.extend(group.expand(engine))
        else:  # wait for the other beams (prefilling, preempted, or over this step's token budget)
            for seq in group.live:
                if seq.index in group.rows and seq.status is SeqStatus.RUNNING:
                    # a copy: a decode graph's rows are views of its output buffer, rewritten by the next replay
                    engine._ahead[seq.seq_id] = group.rows.pop(seq.index).clone()
            group.rows.clear()
    return rest, rest_rows, outputs
