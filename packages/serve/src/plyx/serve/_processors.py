"""Built-in logits processors and samplers, each registered through the ``plyx_samplers`` hook.

The plugin contract (what a third party's ``Component.factory`` must return):

- a **processor** is a callable ``(logits [B, V] float32, state: SamplingState) -> logits [B, V]``;
- a **sampler** is a callable ``(logits [B, V], state) -> token ids [B] int64`` with the attribute
  ``is_sampler = True``.

Factories take per-row parameters as a scalar (same for every row) or a sequence of B values,
so one processor serves a whole batch whose requests differ. Every built-in is pure tensor
arithmetic on the logits' device: no ``.item()``, no host sync, no Python loop over the
vocabulary; the only per-row Python loop is the seeded samplers' noise draw (B kernel launches).
Semantics follow transformers' warpers (``TopPLogitsWarper``...) exactly, which the tests check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BannedTokens",
    "GreedySampler",
    "LogitBias",
    "MinP",
    "MinTokens",
    "MultinomialSampler",
    "PresenceFrequencyPenalty",
    "RepetitionPenalty",
    "SamplingState",
    "Temperature",
    "TopK",
    "TopP",
    "TypicalP",
]

_NEG_INF = float("-inf")


class SamplingState:
    """What processors may read about the rows being decoded; all tensors on the logits' device.

    Attributes:
        prompt_mask: ``[B, V]`` bool, the tokens present in each row's prompt.
        output_counts: ``[B, V]`` int32, how often each token was generated so far.
        num_generated: ``[B]`` int64, tokens generated so far per row.
        generators: per row, the ``torch.Generator`` of a seeded request, or None.
        default_generator: the generator of unseeded rows (None: torch's global one).
    """

    def __init__(
        self,
        prompt_mask: torch.Tensor,
        output_counts: torch.Tensor,
        num_generated: torch.Tensor,
        generators: Sequence[torch.Generator | None],
        default_generator: torch.Generator | None = None,
    ) -> None:
        self.prompt_mask = prompt_mask
        self.output_counts = output_counts
        self.num_generated = num_generated
        self.generators = list(generators)
        self.default_generator = default_generator

    @classmethod
    def for_prompts(
        cls,
        prompts: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        generators: Sequence[torch.Generator | None],
        default_generator: torch.Generator | None = None,
    ) -> SamplingState:
        b = len(prompts)
        device = torch.device(device)
        # built on the host and copied without waiting: indexing a device mask with per-row index tensors
        # would copy each from pageable memory, and each such copy waits for the queued prefill
        prompt_mask = torch.zeros(b, vocab_size, dtype=torch.bool)
        for i, p in enumerate(prompts):  # once per request, before decoding
            prompt_mask[i, torch.as_tensor(list(p), dtype=torch.long)] = True
        if device.type == "cuda":
            prompt_mask = prompt_mask.pin_memory().to(device, non_blocking=True)
        else:
            prompt_mask = prompt_mask.to(device)
        return cls(
            prompt_mask,
            torch.zeros(b, vocab_size, dtype=torch.int32, device=device),
            torch.zeros(b, dtype=torch.long, device=device),
            generators,
            default_generator,
        )

    def update(self, tokens: torch.Tensor) -> None:
        """Record one new token per row (``tokens`` [B] int64), on device."""
        self.output_counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
        self.num_generated += 1

    def select(self, rows: Sequence[int]) -> SamplingState:
        """The state of a subset of rows (after some finished, or for a processor used by some rows)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.prompt_mask.device)
        return SamplingState(
            self.prompt_mask.index_select(0, idx),
            self.output_counts.index_select(0, idx),
            self.num_generated.index_select(0, idx),
            [self.generators[r] for r in rows],
            self.default_generator,
        )


def _column(values: float | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter as a ``[B, 1]`` (or ``[1, 1]`` for a scalar) tensor that broadcasts over V."""
    if isinstance(values, (int, float)):
        return torch.tensor([[values]], dtype=dtype, device=device)
    return torch.tensor(list(values), dtype=dtype, device=device)[:, None]


class _PerRow:
    """Caches per-row parameter tensors per device, built on the first call (one host-to-device copy)."""

    def __init__(self, **params: Any) -> None:
        self._params = params
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _get(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._cache:
            self._cache[key] = _column(self._params[name], dtype, device)
        return self._cache[key]


# ---------------------------------------------------------------------------
# penalties and biases
# ---------------------------------------------------------------------------
class RepetitionPenalty(_PerRow):
    """CTRL repetition penalty (Keskar et al. 2019) over prompt and output tokens.

    For each token seen: ``logit / penalty`` if the logit is positive, ``logit * penalty`` if negative,
    so penalty > 1 always makes a seen token less likely (transformers' ``RepetitionPenaltyLogitsProcessor``).
    """

    def __init__(self, penalty: float | Sequence[float]) -> None:
        super().__init__(penalty=penalty)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        p = self._get("penalty", logits.dtype, logits.device)  # [B, 1]
        seen = state.prompt_mask | (state.output_counts > 0)  # [B, V]
        penalised = torch.where(logits < 0, logits * p, logits / p)
        return torch.where(seen, penalised, logits)


class PresenceFrequencyPenalty(_PerRow):
    """OpenAI's penalties over generated tokens: ``logit - frequency * count - presence * (count > 0)``."""

    def __init__(self, presence: float | Sequence[float] = 0.0, frequency: float | Sequence[float] = 0.0) -> None:
        super().__init__(presence=presence, frequency=frequency)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        counts = state.output_counts.to(logits.dtype)  # [B, V]
        pres = self._get("presence", logits.dtype, logits.device)
        freq = self._get("frequency", logits.dtype, logits.device)
        return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


class LogitBias:
    """Adds a per-row ``{token_id: bias}`` to the logits (OpenAI ``logit_bias``); a dense [B, V] bias built once."""

    def __init__(self, bias: Mapping[int, float] | Sequence[Mapping[int, float] | None]) -> None:
        self._bias = bias
        self._dense: dict[tuple[torch.device, int], torch.Tensor] = {}

    def _table(self, b: int, v: int, device: torch.device) -> torch.Tensor:
        key = (device, v)
        if key not in self._dense:
            rows = [self._bias] if isinstance(self._bias, Mapping) else list(self._bias)
            table = torch.zeros(len(rows), v, dtype=torch.float32)
            for i, row in enumerate(rows):
                for tok, val in (row or {}).items():
                    if 0 <= tok < v:
                        table[i, tok] = float(val)
            self._dense[key] = table.to(device)
        return self._dense[key]

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        return logits + self._table(logits.shape[0], logits.shape[1], logits.device).to(logits.dtype)


class BannedTokens:
    """Sets the logits of per-row banned token ids to -inf (transformers' ``NoBadWordsLogitsProcessor`` for
    single-token words)."""

    def __init__(self, token_ids: Sequence[int] | Sequence[Sequence[int]]) -> None:
        self._ids = token_ids
        self._mask: dict[tuple[torch.device, int], torch.Tensor] = {}

    def _table(self, v: int, device: torch.device) -> torch.Tensor:
        key = (device, v)
        if key not in self._mask:
            ids = self._ids
            rows = [ids] if (len(ids) == 0 or isinstance(ids[0], int)) else list(ids)
            mask = torch.zeros(len(rows), v, dtype=torch.bool)
            for i, row in enumerate(rows):
                row_ids = [t for t in row if 0 <= t < v]  # type: ignore[union-attr]
                mask[i, row_ids] = True
            self._mask[key] = mask.to(device)
        return self._mask[key]

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        return logits.masked_fill(self._table(logits.shape[1], logits.device), _NEG_INF)


class MinTokens(_PerRow):
    """Bans each row's stop tokens until it generated ``min_tokens`` tokens (transformers' ``MinNewTokensLength``)."""

    def __init__(self, min_tokens: int | Sequence[int], stop_token_ids: Sequence[int] | Sequence[Sequence[int]]) -> None:
        super().__init__(min_tokens=min_tokens)
        self._stops = BannedTokens(stop_token_ids)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        need = self._get("min_tokens", torch.long, logits.device)[:, 0]  # [B]
        active = (state.num_generated < need)[:, None]  # [B, 1]
        banned = self._stops._table(logits.shape[1], logits.device) & active
        return logits.masked_fill(banned, _NEG_INF)


# ---------------------------------------------------------------------------
# warpers (transformers' order: temperature, top-k, top-p, min-p, typical)
# ---------------------------------------------------------------------------
class Temperature(_PerRow):
    """``logits / T``; rows with T == 0 (greedy) are left as they are (their sampler takes the argmax)."""

    def __init__(self, temperature: float | Sequence[float]) -> None:
        super().__init__(temperature=temperature)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        t = self._get("temperature", logits.dtype, logits.device)
        return logits / torch.where(t == 0, torch.ones_like(t), t)


class TopK(_PerRow):
    """Keeps the k largest logits per row (ties at the k-th value kept); k == 0 keeps all."""

    def __init__(self, k: int | Sequence[int]) -> None:
        super().__init__(k=k)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        v = logits.shape[-1]
        k = self._get("k", torch.long, logits.device)  # [B, 1]
        k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
        sorted_desc = logits.sort(dim=-1, descending=True).values  # [B, V]
        kth = sorted_desc.gather(-1, (k - 1).expand(logits.shape[0], 1))  # [B, 1]
        return logits.masked_fill(logits < kth, _NEG_INF)


class TopP(_PerRow):
    """Nucleus sampling (Holtzman et al. 2019): drop the least likely tokens whose total mass is <= 1 - p.

    Sorted ascending, a token is removed when the cumulative probability up to and including it is
    <= 1 - p; the most likely token is always kept (transformers' ``TopPLogitsWarper``).
    """

    def __init__(self, p: float | Sequence[float]) -> None:
        super().__init__(p=p)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        p = self._get("p", logits.dtype, logits.device)
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [B, V] ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - p)
        remove_sorted[:, -1] = False  # keep at least the best token
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        return logits.masked_fill(remove, _NEG_INF)


class MinP(_PerRow):
    """Min-p sampling (Nguyen et al. 2024): drop tokens with probability < min_p * max probability."""

    def __init__(self, p: float | Sequence[float]) -> None:
        super().__init__(p=p)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        p = self._get("p", logits.dtype, logits.device)
        probs = logits.softmax(dim=-1)
        threshold = p * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        remove = probs < threshold  # the argmax has probs == max >= threshold: always kept
        return logits.masked_fill(remove, _NEG_INF)


class TypicalP(_PerRow):
    """Locally typical sampling (Meister et al. 2022): keep the tokens whose surprisal is closest to the
    entropy until their mass reaches ``mass`` (transformers' ``TypicalLogitsWarper``)."""

    def __init__(self, mass: float | Sequence[float]) -> None:
        super().__init__(mass=mass)

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        mass = self._get("mass", logits.dtype, logits.device)
        logp = logits.log_softmax(dim=-1)
        p = logp.exp()
        ent = -(logp * p).nansum(-1, keepdim=True)  # [B, 1]; nansum: 0 * -inf for masked tokens
        shifted = (-logp - ent).abs()
        sorted_scores, sorted_idx = shifted.sort(dim=-1, descending=False)
        cum = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
        last = (cum < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # [B, 1]
        remove_sorted = sorted_scores > sorted_scores.gather(1, last)
        remove_sorted[:, 0] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        return logits.masked_fill(remove, _NEG_INF)


# ---------------------------------------------------------------------------
# samplers
# ---------------------------------------------------------------------------
def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens through the kernel registry's fused ``cross_entropy`` with ``return_argmax``.

    The fused kernel reads the ``[B, V]`` logits once for the log-sum-exp and the argmax together (the
    loss against dummy targets is discarded); the registry picks the Triton kernel on GPUs and the
    PyTorch reference elsewhere.
    """
    from plyx.kernel import registry

    fn = registry().get("cross_entropy", logits)
    _, tokens = fn(logits, _dummy_targets(logits.shape[0], logits.device), reduction="none", return_argmax=True)
    return tokens


_DUMMY_TARGETS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _dummy_targets(rows: int, device: torch.device) -> torch.Tensor:
    """Zeros ``[rows]`` (the discarded loss's targets), made once per size and device and only read: a decode
    step's graph then launches no fill for them."""
    key = (rows, device)
    if key not in _DUMMY_TARGETS:
        _DUMMY_TARGETS[key] = torch.zeros(rows, dtype=torch.long, device=device)
    return _DUMMY_TARGETS[key]


class GreedySampler:
    """Argmax of the processed logits (ties: lowest id, as ``torch.argmax`` and transformers), computed by
    the fused cross-entropy-with-argmax kernel."""

    is_sampler = True

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        return _argmax(logits)


class MultinomialSampler:
    """Draws from ``softmax(logits)`` by the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)``.

    ``P(argmax = i) = p_i`` (the minimum of independent ``Exp(p_j)`` variables is attained at i with
    probability ``p_i / sum p``), so this is exact categorical sampling with one vectorised argmax and
    no ``torch.multinomial`` host sync; each seeded row draws its noise from its own generator, so its
    tokens do not depend on the other rows of the batch.
    """

    is_sampler = True

    def __call__(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        noise = exponential_noise(probs.shape, probs.device, state)
        return (probs / noise).argmax(dim=-1)


def exponential_noise(shape: torch.Size | tuple[int, ...], device: torch.device, state: SamplingState) -> torch.Tensor:
    """``Exp(1)`` noise of ``shape`` ([B, ...]); row i from ``state.generators[i]`` when set."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=state.default_generator)
    for i, gen in enumerate(state.generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return noise.clamp_(min=1e-30)  # an exact 0 would turn p / E into inf or nan


def uniform_noise(shape: tuple[int, ...], device: torch.device, state: SamplingState) -> torch.Tensor:
    """``U[0, 1)`` noise of ``shape`` ([B, ...]); row i from ``state.generators[i]`` when set."""
    noise = torch.rand(shape, dtype=torch.float32, device=device, generator=state.default_generator)
    for i, gen in enumerate(state.generators):
        if gen is not None:
            noise[i] = torch.rand(shape[1:], dtype=torch.float32, device=device, generator=gen)
    return noise
