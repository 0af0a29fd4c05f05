"""Per-request sampling inside one batch, through plyx-serve's processors, samplers and grammar masks.

Each step samples the rows whose sequences reached the end of their known tokens.
Rows differ in everything (temperature, penalties, seeds, grammar): the
``LogitsPipeline`` of ``generate()`` applies each processor to the rows that
asked for it, so a row's token does not depend on which other requests share the batch.

**Tensor rows.** A row whose sampling is temperature, top-k, top-p, min-p and ``min_tokens`` alone (no
penalties, bias, bans, typical-p, grammar, plugin processors or samplers; at most ``MAX_STOP_IDS`` stop ids)
is processed by ``process_rows`` from per-row parameter tensors (``RowParams``) instead of the pipeline: the
same arithmetic as the pipeline's processors, in a form a CUDA graph can replay with new values
(``DecodeGraphs.sample_steps`` runs it inside the multi-step graph). Other rows go through the pipeline.

**Random numbers.** Every sampled row draws the uniform of its ``i``-th generated token from a counter-based
generator: Philox-4x32-10 (Salmon et al., SC 2011; the generator behind ``torch``'s CUDA RNG) keyed by the
row's 64-bit seed, counter ``i``. No generator state is carried between steps, so the token depends only on
(seed, index, processed logits): the same with ``decode_steps`` 1 or 8, in a captured graph or eagerly, alone
or batched, after preemption. The token is the inverse CDF of ``softmax(processed logits)`` at that uniform
(one uniform per token, float64 cumulative sums). A seeded request's row seed is ``seed + i`` (completion
``i``); an unseeded row's is drawn at admission from the engine's generator (``Sequence.seed``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import torch
from plyx.serve._outputs import TokenLogprob
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import GreedySampler, SamplingState
from plyx.serve._structured import GrammarMask
from plyx.serve.engine._sequence import Sequence

__all__ = ["MAX_STOP_IDS", "PARAM_WIDTH", "STAGES", "RowParams", "RowSampler", "admission_seed", "block_count",
           "count_tokens", "draw_tokens", "philox4x32", "plain_greedy", "process_rows", "row_seed", "row_uniforms",
           "sample_rows", "sample_rows_tensor", "sample_tokens", "seen_state", "seq_uniforms", "tensor_row"]

#: the most stop ids (EOS and ``stop_token_ids``) a tensor row may have: the width of ``RowParams.stops``
MAX_STOP_IDS = 8

_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_DOMAIN = np.uint64(0x706C7978)  # "plyx" in the counter's third word: these streams are the engine's sampling


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


def tensor_row(seq: Sequence) -> bool:
    """Whether a row's sampling is tensorised (``process_rows``): repetition, presence and frequency penalties,
    ``min_tokens``, temperature, top-k, top-p and min-p only, at most ``MAX_STOP_IDS`` stop ids. Logit bias,
    bans, typical-p, grammar, plugin processors and samplers take the ``LogitsPipeline``."""
    p = seq.params
    return (seq.matcher is None and not p.processors and p.sampler is None
            and not p.logit_bias and not p.banned_token_ids and p.typical_p >= 1.0
            and len(seq.completion.stop_ids) <= MAX_STOP_IDS)


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = 10) -> np.ndarray:
    """Philox-4x32 (Random123's ``philox4x32_R``) of many counters at once, in 64-bit integer arithmetic.

    Args:
        counter: ``[N, 4]`` 32-bit words (any unsigned or non-negative integer dtype).
        key: ``[N, 2]`` 32-bit words.
        rounds: 10 (the standard, what ``torch``'s CUDA generator uses).

    Returns:
        ``[N, 4]`` uint64 array of 32-bit words.
    """
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[:, 0].astype(np.uint64), key[:, 1].astype(np.uint64)
    for r in range(rounds):
        if r:  # the key is bumped between rounds (Weyl sequence)
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = c[0] * _PHILOX_M[0], c[2] * _PHILOX_M[1]  # exact: both factors < 2**32
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK32]
    return np.stack(c, axis=1)


def row_uniforms(seeds: Seq[int], index: np.ndarray) -> np.ndarray:
    """``U[0, 1)`` (53 random bits, float64) of each row's token ``index``: one Philox block per (seed, index).

    Args:
        seeds: ``[R]`` 64-bit row seeds. index: ``[R]`` or ``[R, k]`` generated-token indices.

    Returns:
        float64 array shaped like ``index``.
    """
    index = np.asarray(index, dtype=np.uint64)
    shape = index.shape
    idx = index.reshape(len(seeds), -1)  # [R, k]
    seed = np.asarray([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64)[:, None].repeat(idx.shape[1], 1)
    idx, seed = idx.reshape(-1), seed.reshape(-1)  # [R * k]
    counter = np.stack([idx & _MASK32, idx >> np.uint64(32), np.full_like(idx, _DOMAIN), np.zeros_like(idx)], 1)
    x = philox4x32(counter, np.stack([seed & _MASK32, seed >> np.uint64(32)], 1))
    hi = (x[:, 0] >> np.uint64(5)).astype(np.float64)  # 27 bits
    lo = (x[:, 1] >> np.uint64(6)).astype(np.float64)  # 26 bits
    return ((hi * 67108864.0 + lo) / 9007199254740992.0).reshape(shape)


#: uniforms computed per row at once, ahead of its tokens (``seq_uniforms``): numpy's per-call overhead, not the
#: arithmetic, sets Philox's cost here (~0.2 ms a call for 32 rows), so one call serves a row's next 64 tokens
UNIFORM_WINDOW = 64


def seq_uniforms(seqs: Seq[Sequence], start: np.ndarray, k: int) -> np.ndarray:
    """``row_uniforms`` of each row's tokens ``start[r] .. start[r] + k - 1`` (``[R, k]`` float64), served from
    the rows' windows (``Sequence.uniforms``), refilled ``UNIFORM_WINDOW`` tokens ahead in one call for all rows
    that ran out. The values are a pure function of (seed, index): a window is never stale."""
    out = np.empty((len(seqs), k))
    missing = []
    for r, s in enumerate(seqs):
        i, window = int(start[r]), s.uniforms
        if window is not None and window[0] <= i and i + k <= window[0] + len(window[1]):
            out[r] = window[1][i - window[0]:i - window[0] + k]
        else:
            missing.append(r)
    if missing:
        first = np.asarray([int(start[r]) for r in missing], dtype=np.int64)
        fresh = row_uniforms([seqs[r].seed for r in missing], first[:, None] + np.arange(max(k, UNIFORM_WINDOW)))
        for j, r in enumerate(missing):
            seqs[r].uniforms = (int(first[j]), fresh[j])
            out[r] = fresh[j, :k]
    return out


def row_seed(base: int, seq_id: int) -> int:
    """An unseeded row's 64-bit seed: SplitMix64 of ``base + seq_id`` (``base`` drawn once from the engine's
    generator), so rows' streams differ and a run with the same generator repeats."""
    z = (base + (seq_id + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def admission_seed(engine: Any, params: Any, index: int, seq_id: int) -> int:
    """The row seed of completion ``index`` of a request: ``params.seed + index`` (64 bits), or for an unseeded
    request ``row_seed`` of a base drawn once per ``engine.generator`` (one host sync per generator, not per
    request); 0 for a greedy request (it never draws)."""
    if params.seed is not None:
        return (params.seed + index) & 0xFFFFFFFFFFFFFFFF
    if params.greedy and params.sampler is None:
        return 0
    gen = engine.generator
    cached = getattr(engine, "_seed_base", None)
    if cached is None or cached[0] is not gen:
        base = int(torch.randint(0, 1 << 62, (1,), generator=gen, device=gen.device).item())
        cached = engine._seed_base = (gen, base)
    return row_seed(cached[1], seq_id)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for queued device work (pinned, non-blocking on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


#: columns of a packed ``RowParams`` row (float64; integers are exact below 2**53), then the stop ids
_COLS = ("temperature", "top_p", "min_p", "top_k", "generated", "limit", "min_tokens", "repetition_penalty",
         "presence_penalty", "frequency_penalty")
PARAM_WIDTH = len(_COLS) + MAX_STOP_IDS


class RowParams:
    """Per-row sampling and stop parameters as device tensors, unpacked from one float64 ``[R, PARAM_WIDTH]``
    tensor (one host-to-device copy; a CUDA graph reads it from a persistent buffer).

    Attributes:
        temperature, top_p, min_p: ``[R, 1]`` float32. top_k: ``[R, 1]`` int64 (0: all).
        generated: ``[R]`` int64, tokens the row had generated before the block's first token.
        limit: ``[R]`` int64, the completion's length limit. min_tokens: ``[R]`` int64.
        repetition, presence, frequency: ``[R, 1]`` float32, the penalties (1, 0, 0: none).
        stops: ``[R, MAX_STOP_IDS]`` int64 stop ids, -1 padded. greedy: ``[R]`` bool (temperature 0).
    """

    def __init__(self, packed: torch.Tensor) -> None:
        n = len(_COLS)
        self.temperature = packed[:, 0:1].float()
        self.top_p = packed[:, 1:2].float()
        self.min_p = packed[:, 2:3].float()
        self.top_k = packed[:, 3:4].long()
        self.generated = packed[:, 4].long()
        self.limit = packed[:, 5].long()
        self.min_tokens = packed[:, 6].long()
        self.repetition = packed[:, 7:8].float()
        self.presence = packed[:, 8:9].float()
        self.frequency = packed[:, 9:10].float()
        self.stops = packed[:, n:].long()
        self.greedy = self.temperature[:, 0] == 0

    @staticmethod
    def pack(seqs: Seq[Sequence], offset: int = 0) -> np.ndarray:
        """The rows' parameters, ``[R, PARAM_WIDTH]`` float64; ``offset``: tokens each row chose that its
        ``Sequence`` does not hold yet (a look-ahead block's). Stop ids beyond ``MAX_STOP_IDS`` are left out
        (such rows are not tensor rows: the host's check finds their stops)."""
        pad = [-1] * MAX_STOP_IDS
        rows = []
        for s in seqs:  # one list per row and one array conversion: per-row numpy assignments cost ~5 us each
            p = s.params
            stops = sorted(s.completion.stop_ids)[:MAX_STOP_IDS]
            rows.append([p.temperature, p.top_p, p.min_p, p.top_k,
                         len(s.tokens) - len(s.request.prompt_ids) + offset, s.completion.limit,
                         p.min_tokens, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                         *stops, *pad[len(stops):]])
        return np.array(rows, dtype=np.float64).reshape(len(seqs), PARAM_WIDTH)  # [R, PARAM_WIDTH]

    @staticmethod
    def padding() -> np.ndarray:
        """A neutral row (greedy, no stops, no limit): what a graph's padded batch rows read."""
        row = np.full(PARAM_WIDTH, -1.0)
        row[:len(_COLS)] = (0.0, 1.0, 0.0, 0, 0, 1 << 40, 0, 1.0, 0.0, 0.0)
        return row


def _ban_stops(logits: torch.Tensor, rp: RowParams, generated: torch.Tensor) -> torch.Tensor:
    """``MinTokens``: each row's stop ids at -inf while it generated fewer than ``min_tokens`` tokens."""
    R, V = logits.shape
    idx = torch.where((rp.stops < 0) | (rp.stops >= V), V, rp.stops)  # [R, S]; padding to a scratch column
    table = torch.zeros(R, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, idx, True)[:, :V]  # [R, V]
    return logits.masked_fill(table & (generated < rp.min_tokens)[:, None], float("-inf"))


#: the stages of ``process_rows``, in the pipeline's order
STAGES = ("penalties", "min_tokens", "temperature", "top_k", "top_p", "min_p")


def _penalise(logits: torch.Tensor, rp: RowParams, seen: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``RepetitionPenalty`` then ``PresenceFrequencyPenalty`` (their arithmetic); ``seen``: the rows' prompt
    masks ``[R, V]`` bool and output counts ``[R, V]`` int32. Neutral values (1, 0, 0) change nothing."""
    prompt_mask, counts = seen
    p = rp.repetition
    penalised = torch.where(logits < 0, logits * p, logits / p)
    logits = torch.where(prompt_mask | (counts > 0), penalised, logits)
    c = counts.to(logits.dtype)
    return logits - rp.frequency * c - rp.presence * (c > 0).to(logits.dtype)


def process_rows(logits: torch.Tensor, rp: RowParams, generated: torch.Tensor,
                 stages: tuple[bool, ...] | None = None,
                 seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The tensor rows' processors, in the pipeline's order (``STAGES``: the penalties, ``MinTokens``,
    ``Temperature``, ``TopK``, ``TopP``, ``MinP``; their arithmetic): ``[R, V]`` float32 -> ``[R, V]``.

    ``stages``: which of the six to run (None: all, as a graph does). A stage left out is one every row has
    at its neutral value, where it changes no probability: eager steps skip the work. ``seen``: the penalties'
    prompt masks and output counts (None: no penalty stage).
    """
    on = stages or (True,) * len(STAGES)
    if on[0] and seen is not None:
        logits = _penalise(logits, rp, seen)
    on = on[1:]
    if on[0]:
        logits = _ban_stops(logits, rp, generated)
    if on[1]:
        t = rp.temperature
        logits = logits / torch.where(t == 0, torch.ones_like(t), t)
    desc: tuple[torch.Tensor, torch.Tensor] | None = None
    if on[2]:
        v = logits.shape[-1]
        k = torch.where((rp.top_k <= 0) | (rp.top_k > v), torch.full_like(rp.top_k, v), rp.top_k)  # [R, 1]
        values, order = logits.sort(dim=-1, descending=True)  # [R, V] each
        kth = values.gather(-1, k - 1)  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        desc = (values.masked_fill(values < kth, float("-inf")), order)  # the masked logits, sorted: top-p's too
    if on[3]:
        # ascending order as the pipeline's TopP, from the descending sort (top-k's: one sort per step). Always
        # this sort, whether top-k ran or not: tied logits (common in bf16) then sit in the same order in an
        # eager step and in the graph, so top-p removes the same ones
        values, order = desc if desc is not None else logits.sort(dim=-1, descending=True)  # [R, V] each
        sorted_logits, sorted_idx = values.flip(-1), order.flip(-1)  # ascending
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - rp.top_p)
        remove[:, -1] = False  # keep at least the best token
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    if on[4]:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < rp.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(logits)`` (``[R, V]``) at the row's uniform (``[R]`` float64): the
    inverse CDF, the first token whose float64 cumulative probability exceeds ``u * total``. A token of
    probability 0 is never chosen (its cumulative sum equals its predecessor's)."""
    probs = logits.softmax(dim=-1)  # [R, V]
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    target = uniforms * cdf[:, -1]  # [R]
    tokens = (cdf <= target[:, None]).sum(dim=-1)  # [R]: the first index whose cdf exceeds the target
    return torch.where(tokens < probs.shape[1], tokens, probs.argmax(dim=-1))  # (u * total rounded up to total)


def sample_rows_tensor(logits: torch.Tensor, rp: RowParams, generated: torch.Tensor, uniforms: torch.Tensor,
                       stages: tuple[bool, ...] | None = None, *, any_greedy: bool = True,
                       any_sampled: bool = True, seen: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> torch.Tensor:
    """The tokens of tensor rows: greedy rows the argmax after the penalties and ``MinTokens``, the others
    ``draw_tokens`` of the processed logits. ``[R, V]`` -> ``[R]``; graph-safe (no host sync)."""
    logits = logits.float()  # (bf16 logits: a skipped stage must not change the precision of the rest)
    on = stages or (True,) * len(STAGES)
    if on[0] and seen is not None:
        logits = _penalise(logits, rp, seen)
    if on[1]:
        logits = _ban_stops(logits, rp, generated)
    rest = (False, False, *on[2:])
    greedy = logits.argmax(dim=-1) if any_greedy else None
    if not any_sampled:
        return greedy  # type: ignore[return-value]
    sampled = draw_tokens(process_rows(logits, rp, generated, rest), uniforms)
    return sampled if greedy is None else torch.where(rp.greedy, greedy, sampled)


def block_count(tokens: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """The stop checks of a block on the device: how many of each row's ``[R, k]`` tokens it keeps, up to and
    including the first that finishes it (a stop id, or its ``limit``); ``[R]`` int64 (``k``: none finishes).
    Stop strings are not seen here: the host checks them while accepting (and drops the rest of the row)."""
    R, k = tokens.shape
    hit = (tokens[:, :, None] == rp.stops[:, None, :]).any(dim=-1)  # [R, k]
    steps = torch.arange(1, k + 1, device=tokens.device)  # [k]
    hit |= (rp.generated[:, None] + steps) >= rp.limit[:, None]
    first = torch.where(hit, steps, k + 1).amin(dim=-1)  # [R]: 1-based index of the first finishing token
    return first.clamp(max=k)


def seen_state(seqs: Seq[Sequence], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked prompt masks ``[R, V]`` and output counts ``[R, V]`` of rows (zeros for a row without penalties)."""
    for s in seqs:
        if _needs_state(s):
            _row_state(s, vocab, device)
    zero_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    zero_counts = torch.zeros(vocab, dtype=torch.int32, device=device)
    return (torch.stack([s.prompt_mask if s.prompt_mask is not None else zero_mask for s in seqs]),
            torch.stack([s.output_counts if s.output_counts is not None else zero_counts for s in seqs]))


def count_tokens(seqs: Seq[Sequence], tokens: torch.Tensor) -> None:
    """Add a block's tokens (``[R, k]`` on the device) to the output counts of the rows that keep them (the
    penalised rows), without a host sync. A row that finishes inside the block counts its discarded tail too:
    it never samples again."""
    rows = [i for i, s in enumerate(seqs) if s.output_counts is not None]
    if not rows:
        return
    counts = [seqs[i].output_counts for i in rows]
    picked = tokens if len(rows) == len(seqs) else \
        tokens.index_select(0, _to_device(np.asarray(rows, dtype=np.int64), tokens.device))
    delta = torch.zeros(len(rows), counts[0].shape[0], dtype=torch.int32, device=tokens.device)  # type: ignore[union-attr]
    delta.scatter_add_(1, picked, torch.ones_like(picked, dtype=torch.int32))
    torch._foreach_add_(counts, list(delta.unbind(0)))  # type: ignore[arg-type]


class RowSampler:
    """The sampling of one set of rows, built once and applied to several steps' logits (a multi-step block):
    the parameters and the pipeline of the other rows are made here, so each step adds device work only
    (and a host Philox draw of one uniform per row).

    Args:
        seqs: the rows, in the logits' row order.
        vocab: the logits' width. device: theirs.
        default_generator: the generator of unseeded rows' plugin samplers.
    """

    def __init__(self, seqs: Seq[Sequence], vocab: int, device: torch.device,
                 default_generator: torch.Generator | None) -> None:
        self.greedy = all(plain_greedy(s) for s in seqs)
        if self.greedy:
            return
        V = vocab
        self.device = device
        self.seqs = list(seqs)
        self.generated_host = np.asarray([len(s.tokens) - len(s.request.prompt_ids) for s in seqs], dtype=np.int64)
        # host-to-device copies through pinned memory: a pageable copy would wait for the queued forward
        self.generated = _to_device(self.generated_host, device)
        self.simple = [i for i, s in enumerate(seqs) if tensor_row(s)]
        self.other = [i for i, s in enumerate(seqs) if not tensor_row(s)]
        if self.simple:
            rows = [seqs[i] for i in self.simple]
            self.params = RowParams(_to_device(RowParams.pack(rows), device))
            ps = [s.params for s in rows]
            penalised = any(_needs_state(s) for s in rows)
            self.stages = (penalised, any(p.min_tokens for p in ps), any(p.temperature not in (0.0, 1.0) for p in ps),
                           any(p.top_k > 0 for p in ps), any(p.top_p < 1.0 for p in ps), any(p.min_p > 0 for p in ps))
            self.seen: tuple[torch.Tensor, torch.Tensor] | None = None
            if penalised:  # stacked copies: a block's steps add their tokens to these counts (``advance``)
                self.seen = seen_state(rows, V, device)
            self.any_greedy = any(p.greedy for p in ps)
            self.any_sampled = not all(p.greedy for p in ps)
            self._simple_idx = _to_device(np.asarray(self.simple, dtype=np.int64), device)
        if not self.other:
            return
        rows = [seqs[i] for i in self.other]
        matchers = [s.matcher for s in rows]
        grammar = GrammarMask(matchers, V) if any(m is not None for m in matchers) else None
        self.pipeline = LogitsPipeline([s.params for s in rows], [sorted(s.completion.stop_ids) for s in rows],
                                       grammar)
        n = len(rows)
        if any(_needs_state(s) for s in rows):
            for s in rows:
                _row_state(s, V, device)
            self.prompt_mask = torch.stack([s.prompt_mask for s in rows])  # type: ignore[misc]  # [n, V]
            self.counts = torch.stack([s.output_counts for s in rows])  # type: ignore[misc]  # [n, V]
        else:  # no processor reads them: one shared row of zeros
            self.prompt_mask = torch.zeros(1, V, dtype=torch.bool, device=device).expand(n, V)
            self.counts = torch.zeros(1, V, dtype=torch.int32, device=device).expand(n, V)
        self.generators = [s.generator for s in rows]
        self.default_generator = default_generator
        # built-in multinomial rows draw by the counter-based uniform; greedy and plugin samplers by the pipeline
        self.multinomial = _to_device(np.asarray([s.params.sampler is None and not s.params.greedy for s in rows]),
                                      device)
        self.plugin = any(s.params.sampler is not None for s in rows)
        self._other_idx = _to_device(np.asarray(self.other, dtype=np.int64), device)

    def advance(self, tokens: torch.Tensor) -> None:
        """Count one step's tokens (``[R]``, on the device) in the penalised tensor rows' stacked counts: the next
        step of a block sees them, as the next single step would (``sample_rows`` counts on the host there)."""
        if self.greedy or not self.simple or self.seen is None:
            return
        picked = tokens if not self.other else tokens.index_select(0, self._simple_idx)
        self.seen[1].scatter_add_(1, picked[:, None], torch.ones_like(picked[:, None], dtype=torch.int32))

    def __call__(self, logits: torch.Tensor, generated_offset: int = 0) -> torch.Tensor:
        """One token per row of ``logits`` (``[R, V]``), on the device: no host sync.

        ``generated_offset`` counts tokens each row chose that its ``Sequence`` does not hold yet (step j of a
        block samples as the single step after j more tokens would: ``min_tokens`` and the random stream's
        counter read the count).
        """
        if self.greedy:
            return logits.argmax(dim=-1)  # [R]
        generated = self.generated + generated_offset if generated_offset else self.generated
        uniforms = _to_device(seq_uniforms(self.seqs, self.generated_host + generated_offset, 1)[:, 0],
                              self.device)  # [R]
        if not self.other:
            return sample_rows_tensor(logits, self.params, generated, uniforms, self.stages,
                                      any_greedy=self.any_greedy, any_sampled=self.any_sampled, seen=self.seen)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if self.simple:
            idx = self._simple_idx
            out.index_copy_(0, idx, sample_rows_tensor(
                logits.index_select(0, idx), self.params, generated.index_select(0, idx),
                uniforms.index_select(0, idx), self.stages, any_greedy=self.any_greedy,
                any_sampled=self.any_sampled, seen=self.seen))
        idx = self._other_idx
        gen = generated.index_select(0, idx)
        state = SamplingState(self.prompt_mask, self.counts, gen, self.generators, self.default_generator)
        processed = self.pipeline.process(logits.index_select(0, idx), state)  # [n, V]
        picked = self.pipeline.sample(processed, state) if self.plugin else GreedySampler()(processed, state)
        drawn = draw_tokens(processed, uniforms.index_select(0, idx))
        out.index_copy_(0, idx, torch.where(self.multinomial, drawn, picked))
        return out

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
