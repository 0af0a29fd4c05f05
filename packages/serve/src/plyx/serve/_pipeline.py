"""Turns the ``SamplingParams`` of a batch's rows into one chain of processors and a sampler.

Processors and samplers are looked up by name through the ``plyx_samplers`` hook, so a
third-party distribution's components are used exactly like the built-ins. Only processors
some row needs are built; a processor one row asks for runs on that row's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from plyx.serve import _processors as P
from plyx.serve._params import SamplingParams
from plyx.specs.errors import ConfigError

__all__ = ["BUILTIN_COMPONENTS", "LogitsPipeline", "sampler_components"]

# name -> (factory, description): what the built-in plugin registers
BUILTIN_COMPONENTS: dict[str, tuple[Callable[..., Any], str]] = {
    "repetition_penalty": (P.RepetitionPenalty, "CTRL repetition penalty over prompt and output tokens"),
    "presence_frequency_penalty": (P.PresenceFrequencyPenalty, "OpenAI presence and frequency penalties"),
    "logit_bias": (P.LogitBias, "adds {token_id: bias} to the logits"),
    "banned_tokens": (P.BannedTokens, "never generate these token ids"),
    "min_tokens": (P.MinTokens, "ban stop tokens until min_tokens were generated"),
    "temperature": (P.Temperature, "divide logits by the temperature"),
    "top_k": (P.TopK, "keep the k most likely tokens"),
    "top_p": (P.TopP, "nucleus sampling: keep the smallest set with mass >= p"),
    "min_p": (P.MinP, "drop tokens below min_p times the top probability"),
    "typical_p": (P.TypicalP, "locally typical sampling"),
    "greedy": (P.GreedySampler, "sampler: argmax (fused cross-entropy-with-argmax kernel when available)"),
    "multinomial": (P.MultinomialSampler, "sampler: categorical draw by the exponential race, per-row seeds"),
}


#: the last lookup, by the plugins registered when it ran: the engine builds a pipeline per step, and asking
#: every plugin's hook again each time cost ~0.2 ms a step on a CPU
_COMPONENTS: tuple[Any, dict[str, Any]] | None = None


def sampler_components() -> dict[str, Any]:
    """Factories by name: the ``plyx_samplers`` components, plus the built-ins when plugin autoload is off.
    Looked up again whenever the set of registered plugins changed."""
    global _COMPONENTS
    from plyx.specs.plugins import components, get_plugin_manager

    key = frozenset(id(p) for p in get_plugin_manager().get_plugins())
    if _COMPONENTS is not None and _COMPONENTS[0] == key:
        return _COMPONENTS[1]
    found = {name: comp.factory for name, comp in components("plyx_samplers").items()}
    for name, (factory, _) in BUILTIN_COMPONENTS.items():
        found.setdefault(name, factory)  # PLYX_DISABLE_PLUGIN_AUTOLOAD skips our own plugin too
    _COMPONENTS = (key, found)
    return found


def _lookup(factories: dict[str, Any], name: str, where: str) -> Any:
    if name not in factories:
        raise ConfigError(
            where,
            f"sampler/processor {name!r} not found. It is either misspelled or not installed",
            value=name,
            fix=f"use one of {', '.join(sorted(factories))}, or install the plugin that provides it",
        )
    return factories[name]


def check_plugin_names(params: SamplingParams, where: str) -> None:
    """Fail before compute when a request names a processor or sampler no plugin provides."""
    factories = sampler_components()
    for i, (name, _) in enumerate(params.processors):
        _lookup(factories, name, f"{where}.processors[{i}]")
    if params.sampler is not None:
        _lookup(factories, params.sampler, f"{where}.sampler")


class LogitsPipeline:
    """The processors and samplers of a fixed set of rows; rebuilt when rows finish.

    Args:
        params: one ``SamplingParams`` per row.
        stop_ids: per row, the ids that end it (for ``min_tokens``).
        grammar: a ``GrammarMask`` over the same rows, or None.
    """

    def __init__(self, params: Sequence[SamplingParams], stop_ids: Sequence[Sequence[int]], grammar: Any = None) -> None:
        f = sampler_components()
        self.processors: list[tuple[Any, list[int] | None]] = []  # (processor, rows or None for all)
        n = len(params)

        def add(name: str, **kwargs: Any) -> None:
            self.processors.append((f[name](**kwargs), None))

        def col(attr: str) -> list[Any]:
            return [getattr(p, attr) for p in params]

        if any(p.repetition_penalty != 1.0 for p in params):
            add("repetition_penalty", penalty=col("repetition_penalty"))
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            add("presence_frequency_penalty", presence=col("presence_penalty"), frequency=col("frequency_penalty"))
        if any(p.logit_bias for p in params):
            add("logit_bias", bias=col("logit_bias"))
        if any(p.banned_token_ids for p in params):
            add("banned_tokens", token_ids=[list(p.banned_token_ids) for p in params])
        if any(p.min_tokens for p in params):
            add("min_tokens", min_tokens=col("min_tokens"), stop_token_ids=[list(s) for s in stop_ids])
        if grammar is not None and grammar.rows:
            self.processors.append((grammar, None))
        # plugin processors: one instance per distinct (name, kwargs), applied to the rows that asked
        groups: dict[str, tuple[str, dict[str, Any], list[int]]] = {}
        for r, p in enumerate(params):
            for name, kwargs in p.processors:
                key = name + repr(sorted(kwargs.items()))
                groups.setdefault(key, (name, dict(kwargs), []))[2].append(r)
        for name, kwargs, rows in groups.values():
            proc = _lookup(f, name, "SamplingParams.processors")(**kwargs)
            self.processors.append((proc, None if len(rows) == n else rows))
        if any(p.temperature not in (0.0, 1.0) for p in params):
            add("temperature", temperature=col("temperature"))
        if any(p.top_k > 0 for p in params):
            add("top_k", k=col("top_k"))
        if any(p.top_p < 1.0 for p in params):
            add("top_p", p=col("top_p"))
        if any(p.min_p > 0.0 for p in params):
            add("min_p", p=col("min_p"))
        if any(p.typical_p < 1.0 for p in params):
            add("typical_p", mass=col("typical_p"))

        # samplers: rows grouped by sampler name
        names = [p.sampler or ("greedy" if p.greedy else "multinomial") for p in params]
        self.samplers: list[tuple[Any, list[int] | None]] = []
        for name in dict.fromkeys(names):
            rows = [r for r, x in enumerate(names) if x == name]
            self.samplers.append((_lookup(f, name, "SamplingParams.sampler")(), None if len(rows) == n else rows))

    def process(self, logits: torch.Tensor, state: P.SamplingState) -> torch.Tensor:
        """Apply every processor: ``[B, V]`` float32 -> ``[B, V]``."""
        for proc, rows in self.processors:
            if rows is None:
                logits = proc(logits, state)
            else:
                idx = torch.as_tensor(rows, device=logits.device)
                logits = logits.index_copy(0, idx, proc(logits.index_select(0, idx), state.select(rows)))
        return logits

    def sample(self, logits: torch.Tensor, state: P.SamplingState) -> torch.Tensor:
        """Pick one token per row: ``[B]`` int64 on the logits' device."""
        if len(self.samplers) == 1:
            return self.samplers[0][0](logits, state)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for sampler, rows in self.samplers:
            assert rows is not None
            idx = torch.as_tensor(rows, device=logits.device)
            out.index_copy_(0, idx, sampler(logits.index_select(0, idx), state.select(rows)))
        return out
