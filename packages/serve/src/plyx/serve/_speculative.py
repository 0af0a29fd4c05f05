"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with a draft model of the same vocabulary.

A round, per row: the draft proposes k tokens d_1..d_k autoregressively from its processed
distributions q_1..q_k; the target scores ``[last, d_1..d_k]`` in one forward pass, giving
p_1..p_{k+1}; d_j is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))`` until the first
rejection, where a token is drawn from ``norm(max(0, p_j - q_j))``; if all k are accepted a bonus
token is drawn from p_{k+1}. Each emitted token is then distributed exactly as the target's
(processed) distribution, so sampling output equals non-speculative sampling in law and greedy
output (temperature 0: accept iff d_j is the target's argmax, correct with the argmax) equals
greedy token for token. The target's KV cache is rolled back with ``KVCache.crop``.

With ``draft_model="ngram"`` the draft is a prompt lookup (``plyx.serve._ngram``: no draft model): each
row proposes up to k tokens that followed the latest earlier occurrence of its last n tokens. Such a
proposal is one-hot (q = 1 on the drafted token), so the same rule accepts d_j with probability
p_j(d_j) and resamples from p_j without d_j; positions past a row's (shorter) draft have q = 0 and are
never accepted, so the correction there is drawn from p itself.

Processors must not depend on the tokens generated so far (the k verification positions are
processed in one batch), so penalties, min_tokens, structured output and plugin processors are
rejected up front with a clear error; temperature, top-k, top-p, min-p, typical-p, logit bias and
banned tokens work.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from plyx.serve._completion import Completion
from plyx.serve._ngram import check_lookup, propose
from plyx.serve._outputs import StreamEvent, TokenLogprob
from plyx.serve._params import SamplingParams
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import SamplingState, exponential_noise, uniform_noise
from plyx.serve._runner import Runner, model_device
from plyx.specs.errors import ConfigError

__all__ = ["SpeculativeDecoder"]

# fields whose non-default values make processing depend on the generated prefix
_STATEFUL = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
    "structured": None, "processors": (), "sampler": None,
}


class SpeculativeDecoder:
    """Validates a draft/target pair and runs the speculative loop for a ``_Plan``."""

    def __init__(self, plan: Any, model: Any, draft: Any, *, num_speculative_tokens: int,
                 cache: Any, draft_cache: Any, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3) -> None:
        from plyx.serve._generate import _check_model, _seeded

        self.lookup: tuple[int, int] | None = None
        if isinstance(draft, str):
            if draft != "ngram":
                raise ConfigError("draft_model", f"draft_model {draft!r} is not a method: the one named draft is "
                                  "'ngram' (prompt lookup)", value=draft,
                                  fix="pass draft_model='ngram' or a model with the target's vocabulary")
            check_lookup(prompt_lookup_min, prompt_lookup_max)
            self.lookup = (prompt_lookup_min, prompt_lookup_max)
            dconf = _check_model(model, "model")
        else:
            dconf = _check_model(draft, "draft_model")
        if int(dconf.vocab_size) != plan.vocab:
            raise ConfigError("draft_model", f"the draft model's vocabulary has {dconf.vocab_size} tokens, the "
                              f"target's {plan.vocab}: they must share the tokenizer", value=int(dconf.vocab_size),
                              fix="use a draft model trained with the target's tokenizer")
        if self.lookup is None and model_device(draft) != model_device(model):
            raise ConfigError("draft_model", "the draft and target models must be on the same device",
                              value=str(model_device(draft)), fix=f"move the draft with .to({model_device(model)})")
        if not (isinstance(num_speculative_tokens, int) and 1 <= num_speculative_tokens <= 32):
            raise ConfigError("num_speculative_tokens", "num_speculative_tokens must be an int in [1, 32]",
                              value=num_speculative_tokens, fix="use e.g. 4")
        for i, p in enumerate(plan.params):
            for name, default in _STATEFUL.items():
                if getattr(p, name) != default:
                    raise ConfigError(f"params[{i}].{name}", f"{name} is not supported with speculative decoding "
                                      f"(it depends on the tokens generated so far)", value=getattr(p, name),
                                      fix="drop draft_model for this request or leave the field at its default")
        self.plan = plan
        self.k = num_speculative_tokens
        self.device = model_device(model)
        self.context = min(plan.context, int(dconf.max_seq_len))
        rows_total = sum(p.n for p in plan.params)
        # a verification pass stores up to k tokens past the committed ones
        self.target = Runner(model, cache, num_sequences=rows_total, max_seq_len=plan.longest(self.k + 1))
        self.draft = None if self.lookup is not None else Runner(
            draft, draft_cache, num_sequences=rows_total, max_seq_len=min(int(dconf.max_seq_len),
                                                                          plan.longest(self.k + 1)),
            where="draft_cache")
        self.rows: list[Completion] = []
        self.draft_ids: dict[int, int] = {}  # row position -> draft sequence id
        for r, (ids, p) in enumerate(zip(plan.prompt_ids, plan.params)):
            if len(ids) >= self.context:
                raise ConfigError(f"prompts[{r}]", f"the prompt has {len(ids)} tokens but the draft model's context "
                                  f"is {dconf.max_seq_len}", value=len(ids), fix="use a draft with a longer context")
            for j in range(p.n):
                self.rows.append(Completion(
                    request_index=r, index=j, prompt_ids=ids, params=p, stop_ids=plan.stop_ids(p),
                    context=self.context, tokenizer=plan.tokenizer, seq_id=-1, generator=_seeded(p, j, self.device),
                ))

    # -- the loop ------------------------------------------------------------------------
    def run(self, generator: torch.Generator | None) -> Iterator[StreamEvent]:
        # inference_mode per round, never across a yield (grad mode is thread-local: a suspended generator
        # would leave the consumer in inference mode)
        try:
            with torch.inference_mode():
                events, active, pending = self._start(generator)
            yield from events
            while active:
                with torch.inference_mode():
                    events = self._round(active, pending, generator)
                yield from events
                active = [pos for pos in active if not self.rows[pos].finished]
        finally:
            self.target.close()
            if self.draft is not None:
                self.draft.close()

    def _start(self, generator: torch.Generator | None) -> tuple[list[StreamEvent], list[int], dict[int, list[int]]]:
        """Prefill target and draft, fork the n completions, and take each row's first token from the target."""
        rows = self.rows
        firsts = [c for c in rows if c.index == 0]
        dfirst: dict[int, int] = {}
        draft = self.draft
        for c in firsts:
            c.seq_id = self.target.new_id()
            if draft is not None:
                dfirst[c.request_index] = draft.new_id()
        logits_req = self.target.extend([c.seq_id for c in firsts], [c.prompt_ids for c in firsts])  # [R, V]
        # the draft prefills everything but the last prompt token, which opens its first round
        pending_draft: dict[int, list[int]] = {}
        short = [c for c in firsts if len(c.prompt_ids) > 1]
        if short and draft is not None:
            draft.extend([dfirst[c.request_index] for c in short], [c.prompt_ids[:-1] for c in short])
        for pos, c in enumerate(rows):
            if c.index:
                c.seq_id = self.target.fork(firsts[c.request_index].seq_id)
                if draft is not None:
                    self.draft_ids[pos] = draft.fork(dfirst[c.request_index])
            elif draft is not None:
                self.draft_ids[pos] = dfirst[c.request_index]
            c.model_steps = 1
        logits = logits_req.index_select(0, torch.as_tensor([c.request_index for c in rows], device=self.device))
        state = SamplingState.for_prompts([[] for _ in rows], self.plan.vocab, self.device,
                                          [c.generator for c in rows], generator)
        pipe = LogitsPipeline([c.params for c in rows], [[] for _ in rows])
        tokens = pipe.sample(pipe.process(logits, state), state)
        lps = _logprobs(logits[:, None], tokens[:, None], [c.params for c in rows])
        host = tokens.tolist()
        events: list[StreamEvent] = []
        active: list[int] = []
        for pos, c in enumerate(rows):
            event = c.add([host[pos]], lps[pos])
            if event is not None:
                events.append(event)
            if c.finished:
                self._release(pos)
            else:
                active.append(pos)
                pending_draft[pos] = c.prompt_ids[-1:] + [host[pos]]
        return events, active, pending_draft

    def _release(self, pos: int) -> None:
        self.target.release(self.rows[pos].seq_id)
        if self.draft is not None:
            self.draft.release(self.draft_ids[pos])

    def _round(self, active: list[int], pending_draft: dict[int, list[int]],
               generator: torch.Generator | None) -> list[StreamEvent]:
        rows = [self.rows[pos] for pos in active]
        b = len(rows)
        params = [c.params for c in rows]
        # k this round: never past either context (the verify pass stores k + 1 tokens)
        room = min(self.context - (len(c.prompt_ids) + len(c.token_ids)) for c in rows)
        k = max(0, min(self.k, room - 1))
        state = SamplingState.for_prompts([[] for _ in rows], self.plan.vocab, self.device,
                                          [c.generator for c in rows], generator)
        pipe = LogitsPipeline(params, [[] for _ in rows])
        greedy = torch.tensor([p.greedy for p in params], device=self.device)  # [b]

        # 1. draft: k tokens and their processed distributions q_1..q_k
        proposed = [k] * b  # draft tokens each row really proposes (a lookup may find fewer, or none)
        valid = None  # [b, k] bool: positions holding a proposal (lookup drafts are ragged)
        if self.lookup is not None:
            lists = [propose(c.prompt_ids + c.token_ids, k, *self.lookup) for c in rows]
            proposed = [len(d) for d in lists]
            k = max(proposed, default=0)  # a round where no row found a match is a plain decode step
            drafts = torch.tensor([d + [0] * (k - len(d)) for d in lists], dtype=torch.long,
                                  device=self.device).reshape(b, k)
            valid = torch.arange(k, device=self.device)[None, :] < torch.tensor(proposed, device=self.device)[:, None]
            # one-hot proposals; zeros where there is none (the residual there is p itself)
            q = torch.zeros(b, k, self.plan.vocab, device=self.device)
            q.scatter_(2, drafts[:, :, None], valid[:, :, None].float())
        else:
            drafts = torch.empty(b, k, dtype=torch.long, device=self.device)
            q = torch.empty(b, k, self.plan.vocab, device=self.device)
        if k and self.draft is not None:
            dids = [self.draft_ids[pos] for pos in active]
            dlogits = self.draft.extend(dids, [pending_draft[pos] for pos in active])  # [b, V]
            for j in range(k):
                processed = pipe.process(dlogits.float(), state)
                q[:, j] = processed.softmax(dim=-1)
                drafts[:, j] = pipe.sample(processed, state)
                if j + 1 < k:
                    dlogits = self.draft.step(dids, drafts[:, j])

        # 2. target: one pass over [last, d_1..d_k] -> p_1..p_{k+1}
        last = torch.tensor([c.token_ids[-1] for c in rows], device=self.device)
        verify = torch.cat([last[:, None], drafts], dim=1)  # [b, k + 1]
        tl = self.target.extend([c.seq_id for c in rows], verify.tolist(), all_logits=True)
        tlogits = torch.stack(tl)  # [b, k + 1, V]
        rep = LogitsPipeline([p for p in params for _ in range(k + 1)], [[] for _ in range(b * (k + 1))])
        processed = rep.process(tlogits.reshape(b * (k + 1), -1), state.select([i for i in range(b) for _ in range(k + 1)]))
        p = processed.reshape(b, k + 1, -1).softmax(dim=-1)  # [b, k + 1, V]

        # 3. accept / reject (vectorised over rows and positions)
        if k:
            p_d = p[:, :k].gather(2, drafts[:, :, None])[..., 0]  # [b, k]
            q_d = q.gather(2, drafts[:, :, None])[..., 0]
            u = uniform_noise((b, k), self.device, state)
            sampled_ok = u * q_d < p_d  # u < p/q without dividing by a tiny q
            greedy_ok = drafts == p[:, :k].argmax(dim=-1)
            ok = torch.where(greedy[:, None], greedy_ok, sampled_ok)
            if valid is not None:
                ok &= valid
            n_acc = ok.long().cumprod(dim=1).sum(dim=1)  # [b] accepted prefix length
        else:
            n_acc = torch.zeros(b, dtype=torch.long, device=self.device)
        # 4. the token after the accepted prefix: residual max(0, p - q) after a rejection, p itself after all k
        p_next = p.gather(1, n_acc[:, None, None].expand(b, 1, p.shape[-1]))[:, 0]  # [b, V]
        q_pad = torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], dim=1)  # [b, k + 1, V]; zeros: the bonus position
        q_next = q_pad.gather(1, n_acc[:, None, None].expand(b, 1, p.shape[-1]))[:, 0]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)  # p == q: resample from p
        noise = exponential_noise(residual.shape, self.device, state)
        correction = torch.where(greedy, p_next.argmax(dim=-1), (residual / noise).argmax(dim=-1))

        # the emitted token at position j: d_{j+1} while j < n_acc, then the correction
        emitted = torch.where(torch.arange(k + 1, device=self.device)[None, :] < n_acc[:, None],
                              torch.cat([drafts, correction[:, None]], dim=1), correction[:, None])  # [b, k + 1]
        lps = _logprobs(tlogits, emitted, params)
        n_host, d_host, c_host = n_acc.tolist(), drafts.tolist(), correction.tolist()
        events: list[StreamEvent] = []
        for i, (pos, c) in enumerate(zip(active, rows)):
            n = n_host[i]
            new = d_host[i][:n] + [c_host[i]]
            c.model_steps += 1
            c.draft_proposed += proposed[i]
            c.draft_accepted += n
            event = c.add(new, None if lps[i] is None else lps[i][: n + 1])
            if event is not None:
                events.append(event)
            if c.finished:
                self._release(pos)
                continue
            committed = len(c.prompt_ids) + len(c.token_ids)  # the last token is in neither cache yet
            self.target.crop(c.seq_id, committed - 1)
            if self.draft is None:
                continue
            dlen = self.draft.length(self.draft_ids[pos])
            keep = min(dlen, committed - 1)
            self.draft.crop(self.draft_ids[pos], keep)
            seq = c.prompt_ids + c.token_ids
            pending_draft[pos] = seq[keep:]
        return events


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> list[list[TokenLogprob] | None]:
    """Raw log-probs of ``tokens`` ``[b, m]`` under ``logits`` ``[b, m, V]`` (and top alternatives) for the
    rows that asked; one host copy."""
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return [None] * len(params)
    lp = logits.float().log_softmax(dim=-1)  # [b, m, V]
    chosen = lp.gather(2, tokens[..., None])[..., 0].tolist()  # [b, m]
    k_top = max(w or 0 for w in want)
    tv, ti = lp.topk(k_top, dim=-1) if k_top else (None, None)
    toks = tokens.tolist()
    tvl = tv.tolist() if tv is not None else None
    til = ti.tolist() if ti is not None else None
    out: list[list[TokenLogprob] | None] = []
    for r, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        out.append([
            TokenLogprob(toks[r][j], chosen[r][j],
                         tuple(zip(til[r][j][:w], tvl[r][j][:w])) if w and til is not None and tvl is not None else ())
            for j in range(len(toks[r]))
        ])
    return out
