"""Speculative decoding with draft heads on the base itself: Medusa heads and an EAGLE one-layer draft
(``plyx.model.MedusaHeads`` / ``EagleDraft``, trained by ``plyx train`` with a ``[draft]`` table).

The heads read the base's final-norm hidden states, so the verification pass that scores a round's
drafts also yields the features the next round drafts from: no draft model runs its own context.

A round, per row (chain verification, as ``plyx.serve._speculative`` for a draft model):

- Medusa: the hidden state ``h`` at the last verified position produced the last committed token c;
  head j applied to ``h`` gives q_j for the token j steps after c, and d_j ~ q_j (Cai et al. 2024).
- EAGLE: the draft layer's cache holds one entry ``[embed(x_{i+1}); f_i]`` per position whose base
  feature f_i is known; the entries verified last round are appended and the last output f̂ gives q_1;
  then each drafted token is fed back with the predicted feature (``[embed(d_j); f̂]``) for q_{j+1}
  (Li et al. 2024). Draft entries are cropped after the round: the next one re-feeds true features.
- The base scores ``[c, d_1..d_k]`` in one pass; d_j is accepted with probability
  ``min(1, p_j(d_j) / q_j(d_j))`` until the first rejection, where a token is drawn from
  ``norm(max(0, p_j - q_j))``; after k acceptances a bonus token is drawn from p_{k+1} (Leviathan et al.
  2023). Each q_j is a function of the committed prefix (and the drafts before it), so every emitted
  token is distributed exactly as the base's processed distribution; greedy rows accept iff d_j is the
  base's argmax, so greedy output equals greedy decoding of the base token for token.

Processors that depend on the generated tokens (penalties, min_tokens, structured output, plugins) are
rejected up front, as for every speculative mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from plyx.serve._completion import Completion
from plyx.serve._outputs import StreamEvent, TokenLogprob
from plyx.serve._params import SamplingParams
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import SamplingState, exponential_noise, uniform_noise
from plyx.serve._runner import Runner, left_pad, model_device
from plyx.serve._speculative import _logprobs as speculative_logprobs
from plyx.specs.errors import ConfigError

__all__ = ["HeadsDecoder", "is_draft_heads", "resolve_heads"]

# fields whose non-default values make processing depend on the generated prefix
_STATEFUL = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
    "structured": None, "processors": (), "sampler": None,
}


def is_draft_heads(draft: Any) -> bool:
    """True for ``MedusaHeads`` / ``EagleDraft`` modules and for a path (``str`` other than ``"ngram"``,
    or ``os.PathLike``) to saved heads: what ``generate(..., draft_model=...)`` hands to ``HeadsDecoder``."""
    if isinstance(draft, os.PathLike) or (isinstance(draft, str) and draft != "ngram"):
        return True
    return getattr(draft, "kind", None) in ("medusa", "eagle") and hasattr(draft, "base_config")


def resolve_heads(draft: Any, model: Any, where: str = "draft_model") -> Any:
    """The heads module for ``model``: loaded from a path (onto the base's device and dtype) or checked.

    ``where`` names the option in errors (``draft_model`` for ``generate``, ``EngineConfig.draft_heads``).

    Raises:
        ConfigError: ``draft_model`` names no draft-heads directory, or the heads were trained for a
            base of another shape (the message names each differing field).
    """
    from plyx.model import DraftHeadsError, load_draft_heads
    from plyx.model._draft_heads import check_base

    if isinstance(draft, (str, os.PathLike)) and not Path(draft).exists():
        if where != "draft_model":
            raise ConfigError(where, f"{str(draft)!r} is not an existing draft-heads directory", value=str(draft),
                              fix="pass the directory `plyx train` wrote with a [draft] table (it holds "
                              "draft_heads.json)")
        raise ConfigError(where, f"draft_model {str(draft)!r} is neither 'ngram' (prompt lookup) nor an "
                          "existing draft-heads directory", value=str(draft),
                          fix="pass 'ngram', a draft model with the target's vocabulary, or the directory `plyx train` "
                          "wrote with a [draft] table (it holds draft_heads.json)")
    try:
        if isinstance(draft, (str, os.PathLike)):
            return load_draft_heads(Path(draft), model, device=model_device(model))
        check_base({k: getattr(draft.base_config, k) for k in ("vocab_size", "d_model", "n_heads", "n_kv_heads",
                                                                "head_dim", "d_ff", "arch", "rope_theta")},
                   model.config, source=f"the {draft.kind} draft heads")
    except DraftHeadsError as exc:
        fix = "draft heads trained on this base (plyx train with a [draft] table)"
        raise ConfigError(where, str(exc), value=str(draft) if isinstance(draft, (str, os.PathLike))
                          else draft.kind, fix=f"pass 'ngram', a draft model, or {fix}" if where == "draft_model"
                          else f"pass {fix}") from None
    if model_device(draft) != model_device(model):
        raise ConfigError(where, "the draft heads and the base must be on the same device",
                          value=str(model_device(draft)), fix=f"move the heads with .to({model_device(model)})")
    return draft


class HeadsDecoder:
    """Validates base + heads and runs the draft-heads speculative loop for a ``_Plan``.

    Same constructor as ``SpeculativeDecoder`` (``generate`` picks this one for draft heads);
    ``prompt_lookup_*`` are ignored. ``num_speculative_tokens`` is capped at a Medusa model's head count.
    """

    def __init__(self, plan: Any, model: Any, draft: Any, *, num_speculative_tokens: int,
                 cache: Any, draft_cache: Any, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3) -> None:
        from plyx.serve._generate import _check_model, _seeded

        _check_model(model, "model")
        self.heads = resolve_heads(draft, model)
        self.kind = self.heads.kind
        if getattr(model, "lm_head_weight", None) is None:
            raise ConfigError("model", "draft heads need the base's LM head (`lm_head_weight`) and hidden states "
                              "(`return_hidden=True`)", value=type(model).__name__, fix="use a plyx.model.TransformerLM")
        if cache is None:
            raise ConfigError("use_cache", "draft heads decode with the KV cache (the heads read the hidden states "
                              "of each verification pass)", value=False, fix="leave use_cache=True")
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
        self.model = model
        self.k = min(num_speculative_tokens, self.heads.num_heads) if self.kind == "medusa" else num_speculative_tokens
        self.device = model_device(model)
        self.context = plan.context
        rows_total = sum(p.n for p in plan.params)
        # a verification pass stores up to k tokens past the committed ones
        self.target = Runner(model, cache, num_sequences=rows_total, max_seq_len=plan.longest(self.k + 1))
        self.draft = None if self.kind == "medusa" else Runner(
            self.heads, draft_cache, num_sequences=rows_total, max_seq_len=plan.longest(self.k + 1),
            where="draft_cache")
        self.rows: list[Completion] = []
        for r, (ids, p) in enumerate(zip(plan.prompt_ids, plan.params)):
            for j in range(p.n):
                self.rows.append(Completion(
                    request_index=r, index=j, prompt_ids=ids, params=p, stop_ids=plan.stop_ids(p),
                    context=self.context, tokenizer=plan.tokenizer, seq_id=-1, generator=_seeded(p, j, self.device),
                ))
        self.draft_ids: dict[int, int] = {}  # row position -> draft-layer sequence id (EAGLE)
        self.feature: dict[int, torch.Tensor] = {}  # Medusa: [D] hidden state that produced the last token
        # EAGLE: entries known but not yet in the draft cache: (tokens x_{i+1}, features f_i [n, D])
        self.pending: dict[int, tuple[list[int], torch.Tensor]] = {}

    # -- model calls ---------------------------------------------------------------------
    def _hidden(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The base over each row's new tokens (cached): final-norm hidden states ``[T_i, D]`` per row."""
        ids, mask = left_pad(tokens, self.device)
        hidden = self.model(ids, attention_mask=mask, cache=self.target.cache, seq_ids=list(seq_ids),
                            return_hidden=True)  # (B, T, D)
        width = hidden.shape[1]
        return [hidden[i, width - len(t):] for i, t in enumerate(tokens)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.matmul(hidden, self.model.lm_head_weight.t()).float()  # (..., V)

    def _eagle(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append entries to the draft layer's cache; ``[B, D]``: each row's last predicted feature."""
        assert self.draft is not None
        width = max(len(t) for t in tokens)
        ids, mask = left_pad(tokens, self.device)
        feats = torch.zeros(len(tokens), width, features[0].shape[-1], dtype=features[0].dtype, device=self.device)
        for i, f in enumerate(features):
            feats[i, width - f.shape[0]:] = f  # right-aligned as the ids
        out = self.heads(ids, feats, self.model.embed_tokens.weight, attention_mask=mask, cache=self.draft.cache,
                         seq_ids=list(seq_ids))  # (B, T, D)
        return out[:, -1]

    # -- the loop ------------------------------------------------------------------------
    def run(self, generator: torch.Generator | None) -> Iterator[StreamEvent]:
        # inference_mode per round, never across a yield (grad mode is thread-local)
        try:
            with torch.inference_mode():
                events, active = self._start(generator)
            yield from events
            while active:
                with torch.inference_mode():
                    events = self._round(active, generator)
                yield from events
                active = [pos for pos in active if not self.rows[pos].finished]
        finally:
            self.target.close()
            if self.draft is not None:
                self.draft.close()

    def _start(self, generator: torch.Generator | None) -> tuple[list[StreamEvent], list[int]]:
        """Prefill the base, fork the n completions, take each row's first token from the base."""
        rows = self.rows
        firsts = [c for c in rows if c.index == 0]
        for c in firsts:
            c.seq_id = self.target.new_id()
        hidden = self._hidden([c.seq_id for c in firsts], [c.prompt_ids for c in firsts])  # R x [P_r, D]
        for c in rows:
            if c.index:
                c.seq_id = self.target.fork(firsts[c.request_index].seq_id)
            c.model_steps = 1
        last = torch.stack([hidden[c.request_index][-1] for c in rows])  # (B, D)
        logits = self._logits(last)  # (B, V)
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
                self.target.release(c.seq_id)
                continue
            active.append(pos)
            if self.draft is None:
                self.feature[pos] = last[pos]
            else:  # entries i = 0..P-1: [embed(x_{i+1}); f_i], x_P the row's first token
                self.draft_ids[pos] = self.draft.new_id()
                self.pending[pos] = (c.prompt_ids[1:] + [host[pos]], hidden[c.request_index])
        return events, active

    def _release(self, pos: int) -> None:
        self.target.release(self.rows[pos].seq_id)
        if self.draft is not None:
            self.draft.release(self.draft_ids[pos])

    def _draft(self, active: list[int], k: int, pipe: LogitsPipeline, state: SamplingState
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens per row ``[b, k]`` and their processed distributions q ``[b, k, V]``."""
        b = len(active)
        drafts = torch.empty(b, k, dtype=torch.long, device=self.device)
        q = torch.empty(b, k, self.plan.vocab, device=self.device)
        if self.draft is None:  # Medusa: all k heads from one hidden state per row
            hs = torch.stack([self.feature[pos] for pos in active])  # (b, D)
            head_logits = self.heads(hs)  # (K, b, V)
            for j in range(k):
                processed = pipe.process(head_logits[j], state)
                q[:, j] = processed.softmax(dim=-1)
                drafts[:, j] = pipe.sample(processed, state)
            return drafts, q
        dids = [self.draft_ids[pos] for pos in active]
        feat = self._eagle(dids, [self.pending[pos][0] for pos in active], [self.pending[pos][1] for pos in active])
        for j in range(k):
            processed = pipe.process(self._logits(feat), state)
            q[:, j] = processed.softmax(dim=-1)
            drafts[:, j] = pipe.sample(processed, state)
            if j + 1 < k:  # the drafted token with the predicted feature: EAGLE's autoregression over features
                feat = self.heads(drafts[:, j:j + 1], feat[:, None], self.model.embed_tokens.weight,
                                  cache=self.draft.cache, seq_ids=dids)[:, -1]
        return drafts, q

    def _round(self, active: list[int], generator: torch.Generator | None) -> list[StreamEvent]:
        rows = [self.rows[pos] for pos in active]
        b = len(rows)
        params = [c.params for c in rows]
        room = min(self.context - (len(c.prompt_ids) + len(c.token_ids)) for c in rows)
        k = max(0, min(self.k, room - 1))  # the verify pass stores k + 1 tokens
        state = SamplingState.for_prompts([[] for _ in rows], self.plan.vocab, self.device,
                                          [c.generator for c in rows], generator)
        pipe = LogitsPipeline(params, [[] for _ in rows])
        greedy = torch.tensor([p.greedy for p in params], device=self.device)  # [b]

        # 1. draft: k tokens and their processed distributions q_1..q_k
        if k:
            drafts, q = self._draft(active, k, pipe, state)
        else:  # no room for a draft: a plain decode step (EAGLE's pending entries wait for the next round)
            drafts = torch.empty(b, 0, dtype=torch.long, device=self.device)
            q = torch.empty(b, 0, self.plan.vocab, device=self.device)

        # 2. base: one pass over [last, d_1..d_k] -> hidden states and p_1..p_{k+1}
        last = torch.tensor([c.token_ids[-1] for c in rows], device=self.device)
        verify = torch.cat([last[:, None], drafts], dim=1)  # [b, k + 1]
        # every row verifies k + 1 tokens: no padding, so the ids stay on the device (no host sync before the pass)
        hidden = self.model(verify, cache=self.target.cache, seq_ids=[c.seq_id for c in rows],
                            return_hidden=True)  # [b, k + 1, D]
        tlogits = self._logits(hidden)  # [b, k + 1, V]
        rep = LogitsPipeline([p for p in params for _ in range(k + 1)], [[] for _ in range(b * (k + 1))])
        processed = rep.process(tlogits.reshape(b * (k + 1), -1),
                                state.select([i for i in range(b) for _ in range(k + 1)]))
        p = processed.reshape(b, k + 1, -1).softmax(dim=-1)  # [b, k + 1, V]

        # 3. accept / reject, vectorised over rows and positions
        if k:
            p_d = p[:, :k].gather(2, drafts[:, :, None])[..., 0]  # [b, k]
            q_d = q.gather(2, drafts[:, :, None])[..., 0]
            u = uniform_noise((b, k), self.device, state)
            sampled_ok = u * q_d < p_d  # u < p/q without dividing by a tiny q
            greedy_ok = drafts == p[:, :k].argmax(dim=-1)
            ok = torch.where(greedy[:, None], greedy_ok, sampled_ok)
            n_acc = ok.long().cumprod(dim=1).sum(dim=1)  # [b] accepted prefix length
        else:
            n_acc = torch.zeros(b, dtype=torch.long, device=self.device)
        # 4. the token after the accepted prefix: residual max(0, p - q) after a rejection, p after all k
        V = p.shape[-1]
        p_next = p.gather(1, n_acc[:, None, None].expand(b, 1, V))[:, 0]  # [b, V]
        q_pad = torch.cat([q, q.new_zeros(b, 1, V)], dim=1)  # [b, k + 1, V]; zeros: the bonus position
        q_next = q_pad.gather(1, n_acc[:, None, None].expand(b, 1, V))[:, 0]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)  # p == q: resample from p
        noise = exponential_noise(residual.shape, self.device, state)
        correction = torch.where(greedy, p_next.argmax(dim=-1), (residual / noise).argmax(dim=-1))

        emitted = torch.where(torch.arange(k + 1, device=self.device)[None, :] < n_acc[:, None],
                              torch.cat([drafts, correction[:, None]], dim=1), correction[:, None])  # [b, k + 1]
        lps = _logprobs(tlogits, emitted, params)
        n_host, d_host, c_host = n_acc.tolist(), drafts.tolist(), correction.tolist()
        events: list[StreamEvent] = []
        for i, (pos, c) in enumerate(zip(active, rows)):
            n = n_host[i]
            new = d_host[i][:n] + [c_host[i]]
            c.model_steps += 1
            c.draft_proposed += k
            c.draft_accepted += n
            event = c.add(new, None if lps[i] is None else lps[i][: n + 1])
            if event is not None:
                events.append(event)
            if c.finished:
                self._release(pos)
                continue
            committed = len(c.prompt_ids) + len(c.token_ids)  # the last token is not in the cache yet
            self.target.crop(c.seq_id, committed - 1)
            if self.draft is None:
                self.feature[pos] = hidden[i, n]  # the state whose p gave the correction token
            else:
                # drop the drafted entries; the verified positions' true features come next round
                known = self.draft.length(self.draft_ids[pos]) - max(0, k - 1)
                self.draft.crop(self.draft_ids[pos], known)
                if k:
                    self.pending[pos] = (new, hidden[i, : n + 1])
                else:
                    tokens, feats = self.pending[pos]
                    self.pending[pos] = (tokens + new, torch.cat([feats, hidden[i, : n + 1]]))
        return events


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
              ) -> list[list[TokenLogprob] | None]:
    """Raw log-probs of ``tokens`` ``[b, m]`` under the first m positions of ``logits`` ``[b, >=m, V]``:
    the speculative decoder's helper on the verified prefix."""
    return speculative_logprobs(logits[:, :tokens.shape[1]], tokens, params)
