"""Per-request sampling inside one batch, through plyx-serve's processors, samplers and grammar masks.

Each step samples the rows whose sequences reached the end of their known tokens.
Rows differ in everything (temperature, penalties, seeds, grammar): the
``LogitsPipeline`` of ``generate()`` applies each processor to the rows that
asked for it and each row's seeded generator draws its own noise, so a row's
token does not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from plyx.serve._outputs import TokenLogprob
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import SamplingState
from plyx.serve._structured import GrammarMask
from plyx.serve.engine._sequence import Sequence

__all__ = ["RowSampler", "plain_greedy", "sample_rows", "sample_tokens"]


def _needs_state(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _row_state(seq: Sequence, vocab: int, device: torch.device) -> None:
    """Build the prompt mask and output counts of a penalised row once (kept across steps and preemption)."""
    if seq.prompt_mask is None:
        seq.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        seq.prompt_mask[torch.as_tensor(seq.request.prompt_ids, dtype=torch.long, device=device)] = True
        seq.output_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        generated = seq.tokens[len(seq.request.prompt_ids):]
        if generated:
            ones = torch.ones(len(generated), dtype=torch.int32, device=device)
            seq.output_counts.index_add_(0, torch.as_tensor(generated, device=device), ones)


def plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing that changes the argmax (no processors, grammar, penalties, bias, bans, min_tokens)."""
    p = seq.params
    return (p.greedy and seq.matcher is None and not p.processors and p.sampler is None and not _needs_state(seq)
            and not p.logit_bias and not p.banned_token_ids and not p.min_tokens)


class RowSampler:
    """The sampling of one set of rows, built once and applied to several steps' logits (a multi-step block):
    the processors pipeline and its state are made here, so each step adds device work only.

    Args:
        seqs: the rows, in the logits' row order.
        vocab: the logits' width. device: theirs.
        default_generator: the generator of unseeded rows.
    """

    def __init__(self, seqs: Seq[Sequence], vocab: int, device: torch.device,
                 default_generator: torch.Generator | None) -> None:
        self.greedy = all(plain_greedy(s) for s in seqs)
        if self.greedy:
            return
        R, V = len(seqs), vocab
        matchers = [s.matcher for s in seqs]
        grammar = GrammarMask(matchers, V) if any(m is not None for m in matchers) else None
        self.pipeline = LogitsPipeline([s.params for s in seqs], [sorted(s.completion.stop_ids) for s in seqs],
                                       grammar)
        if any(_needs_state(s) for s in seqs):
            for s in seqs:
                _row_state(s, V, device)
            self.prompt_mask = torch.stack([s.prompt_mask for s in seqs])  # type: ignore[misc]  # [R, V]
            self.counts = torch.stack([s.output_counts for s in seqs])  # type: ignore[misc]  # [R, V]
        else:  # no processor reads them: one shared row of zeros
            self.prompt_mask = torch.zeros(1, V, dtype=torch.bool, device=device).expand(R, V)
            self.counts = torch.zeros(1, V, dtype=torch.int32, device=device).expand(R, V)
        self.generated = torch.tensor([len(s.tokens) - len(s.request.prompt_ids) for s in seqs], device=device)
        self.generators = [s.generator for s in seqs]
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, generated_offset: int = 0) -> torch.Tensor:
        """One token per row of ``logits`` (``[R, V]``), on the device: no host sync.

        ``generated_offset`` counts tokens each row chose that its ``Sequence`` does not hold yet (step j of a
        block samples as the single step after j more tokens would: ``min_tokens`` reads the count).
        """
        if self.greedy:
            return logits.argmax(dim=-1)  # [R]
        generated = self.generated + generated_offset if generated_offset else self.generated
        state = SamplingState(self.prompt_mask, self.counts, generated, self.generators, self.default_generator)
        return self.pipeline.sample(self.pipeline.process(logits, state), state)  # [R]


def sample_tokens(seqs: Seq[Sequence], logits: torch.Tensor, default_generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` (``[R, V]``, row i for ``seqs[i]``), on the device: no host sync."""
    return RowSampler(seqs, logits.shape[1], logits.device, default_generator)(logits)


def sample_rows(seqs: Seq[Sequence], logits: torch.Tensor, default_generator: torch.Generator | None,
                before_sync: Callable[[torch.Tensor], None] | None = None,
                ) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits`` (``[R, V]`` float32, row i for ``seqs[i]``); and its log-probabilities.

    ``before_sync(tokens)`` is called with the chosen tokens still on the device (``[R]``), before the step's one
    wait for them: the engine queues the next forward there (look-ahead), so the device works while the host
    reads the tokens and handles them.
    """
    tokens = sample_tokens(seqs, logits, default_generator)
    if before_sync is not None:
        before_sync(tokens)
    out = tokens.tolist()  # the one host sync of the step
    for s, t in zip(seqs, out):
        if s.output_counts is not None:
            s.output_counts[t] += 1
    return out, _logprobs(seqs, logits, tokens)


def _logprobs(seqs: Seq[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> list[TokenLogprob | None]:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return result
    idx = torch.as_tensor(rows, device=logits.device)
    logp = logits.index_select(0, idx).log_softmax(dim=-1)  # [r, V]: the model's distribution, before processors
    chosen = logp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
    k = max(seqs[i].params.logprobs or 0 for i in rows)
    top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
    for j, i in enumerate(rows):
        kk = seqs[i].params.logprobs or 0
        top = tuple(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist())) if kk else ()  # type: ignore[index]
        result[i] = TokenLogprob(token_id=int(tokens[i]), logprob=float(chosen[j]), top=top)
    return result
