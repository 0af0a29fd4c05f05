"""Reward functions of GRPO: the built-ins, plugin lookup, and scoring that survives a failing plugin.

A reward function has TRL's batch signature::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` carries the record's extra fields, one list per field (``answer=[...]``), and
``completion_ids`` (the sampled token ids); ``None`` skips a sample (no reward from this function).
Functions come from the ``plyx_reward_functions`` hook: each ``Component.factory(**options)`` returns
one. plyx-rl's own plugin registers the built-ins here:

- ``exact_match``: 1 when the completion (stripped) equals ``answer``, else 0 (the task generator's check).
- ``numeric_match``: 1 when the last number in the completion equals ``answer`` within ``tolerance``;
  None where the answer is not a number.
- ``regex_format``: ``reward`` when ``pattern`` matches (``fullmatch`` or ``search``), else ``penalty``.
- ``length_penalty``: DAPO's soft overlong punishment: 0 up to ``max_length - cache``, then linear to -1 at
  ``max_length``, -1 beyond (lengths in tokens from ``completion_ids``, else characters).
- ``reward_model``: a trained Bradley-Terry reward model (``plyx.rl._reward_model``), imported on first use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "RewardFn",
    "RewardScores",
    "build_rewards",
    "exact_match",
    "length_penalty",
    "numeric_match",
    "regex_format",
    "reward_model",
    "reward_components",
    "score_completions",
]

RewardFn = Callable[..., Sequence[float | None]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _column(columns: Mapping[str, Any], name: str, n: int, who: str) -> list[Any]:
    values = columns.get(name)
    if values is None:
        raise ValueError(f"reward {who!r} needs the column {name!r} in every record (e.g. {{\"prompt\": ..., "
                       f"\"{name}\": ...}}); the data has: {', '.join(sorted(columns)) or 'no extra columns'}")
    if len(values) != n:
        raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
    return list(values)


def exact_match(*, strip: bool = True, column: str = "answer") -> RewardFn:
    """1.0 when the completion equals the record's ``column`` (both stripped unless ``strip=False``), else 0.0."""
    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        answers = _column(columns, column, len(completions), "exact_match")
        out: list[float | None] = []
        for c, a in zip(completions, answers):
            if a is None:
                out.append(None)
                continue
            c2, a2 = (c.strip(), str(a).strip()) if strip else (c, str(a))
            out.append(1.0 if c2 == a2 else 0.0)
        return out

    return reward


def numeric_match(*, tolerance: float = 0.0, column: str = "answer") -> RewardFn:
    """1.0 when the completion's last number is within ``tolerance`` of the answer; None if the answer is no number."""
    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        answers = _column(columns, column, len(completions), "numeric_match")
        out: list[float | None] = []
        for c, a in zip(completions, answers):
            try:
                target = float(a)
            except (TypeError, ValueError):
                out.append(None)  # not a numeric task: this function has nothing to say
                continue
            found = _NUMBER.findall(c)
            out.append(1.0 if found and abs(float(found[-1]) - target) <= tolerance else 0.0)
        return out

    return reward


def regex_format(*, pattern: str, mode: str = "fullmatch", reward: float = 1.0, penalty: float = 0.0) -> RewardFn:
    """``reward`` when ``pattern`` matches the completion (``mode``: fullmatch | search), else ``penalty``."""
    if mode not in ("fullmatch", "search"):
        raise ValueError(f"regex_format mode must be 'fullmatch' or 'search' (got {mode!r})")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"regex_format pattern {pattern!r} does not compile: {exc}; fix the pattern "
                         "(TOML: single quotes keep backslashes literal)") from exc
    match = compiled.fullmatch if mode == "fullmatch" else compiled.search

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return [reward if match(c.strip()) else penalty for c in completions]

    return fn


def length_penalty(*, max_length: int, cache: int = 0, unit: str = "tokens") -> RewardFn:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to ``max_length - cache``, then linear
    down to -1 at ``max_length``, -1 beyond. ``unit``: tokens (``completion_ids``) | chars."""
    if max_length < 1 or not 0 <= cache < max_length:
        raise ValueError(f"length_penalty needs max_length >= 1 and 0 <= cache < max_length (got {max_length}, "
                         f"{cache})")
    if unit not in ("tokens", "chars"):
        raise ValueError(f"length_penalty unit must be 'tokens' or 'chars' (got {unit!r})")
    free = max_length - cache

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        if unit == "tokens":
            lengths = [len(ids) for ids in _column(columns, "completion_ids", len(completions), "length_penalty")]
        else:
            lengths = [len(c) for c in completions]
        out: list[float | None] = []
        for n in lengths:
            if n <= free:
                out.append(0.0)
            elif n <= max_length:
                out.append((free - n) / cache)
            else:
                out.append(-1.0)
        return out

    return fn


def reward_model(**options: Any) -> RewardFn:
    """A trained reward model's scores (``plyx.rl._reward_model.reward_model_reward``; options: checkpoint, device,
    batch_size)."""
    from plyx.rl import _reward_model  # type: ignore[attr-defined]  # imported on first use

    return _reward_model.reward_model_reward(**options)  # type: ignore[no-any-return]


# -- lookup -------------------------------------------------------------------------------
def reward_components() -> dict[str, Any]:
    """Every reward ``Component`` the installed plugins provide, by name (``plyx_reward_functions``)."""
    from plyx.specs import components

    return components("plyx_reward_functions")


def build_rewards(specs: Sequence[Any]) -> list[tuple[str, float, RewardFn]]:
    """``(name, weight, fn)`` of each ``RewardSpec`` (``name``, ``weight``, ``args``).

    Raises:
        LookupError: a name no plugin provides (the message lists those installed).
        ValueError: a factory refused its options.
    """
    found = reward_components()
    out = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name not in found:
            raise LookupError(f"reward {spec.name!r} (rewards[{i}].name) not found. It is either misspelled or not "
                              f"installed (available: {', '.join(sorted(found)) or 'none'})")
        label = spec.label or spec.name
        if label in seen:
            raise ValueError(f"two rewards are named {label!r} (rewards[{i}]); give one a `label`")
        seen.add(label)
        try:
            fn = found[spec.name].factory(**dict(spec.args))
        except TypeError as exc:
            raise ValueError(f"rewards[{i}] ({spec.name}): bad args {dict(spec.args)}: {exc}") from exc
        out.append((label, float(spec.weight), fn))
    return out


# -- scoring -------------------------------------------------------------------------------
@attrs.frozen
class RewardScores:
    """Scores of one batch of completions.

    Attributes:
        per_function: ``{label: [N] floats, NaN where the function returned None or failed}``.
        total: ``[N]`` weighted sum over the functions that scored the sample; NaN where none did.
        errors: ``{label: samples whose scoring raised}``.
        skipped: ``{label: samples the function returned None for}``.
        first_error: the first exception's text (``label: Type: message``), or None.
    """

    per_function: dict[str, list[float]]
    total: list[float]
    errors: dict[str, int]
    skipped: dict[str, int]
    first_error: str | None


class RewardError(RuntimeError):
    """A reward function raised (strict mode) or returned something other than ``N`` floats / None."""


def _valid(values: Any, n: int, label: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise RewardError(f"reward {label!r} returned {type(values).__name__} of length "
                          f"{len(values) if hasattr(values, '__len__') else '?'} for {n} completions; return a list "
                          "with one float (or None) per completion")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        else:
            f = float(v)
            out.append(f if math.isfinite(f) else math.nan)
    return out


def score_completions(rewards: Sequence[tuple[str, float, RewardFn]], prompts: list[str], completions: list[str],
                      columns: Mapping[str, list[Any]], *, strict: bool = False) -> RewardScores:
    """Score a batch with every reward function.

    A function that raises on the batch is called again sample by sample, so only the samples it fails on
    are scored None (counted in ``errors``); with ``strict`` the first exception stops the run
    (``RewardError`` naming the function and the sample).
    """
    n = len(completions)
    per: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    skipped: dict[str, int] = {}
    first_error: str | None = None
    for label, _, fn in rewards:
        try:
            values = _valid(fn(prompts, completions, **columns), n, label)
        except RewardError:
            raise
        except Exception as exc:
            if strict:
                raise RewardError(f"reward {label!r} raised {type(exc).__name__}: {exc} (strict mode; without "
                                  "--strict the failing samples are scored None and counted)") from exc
            first_error = first_error or f"{label}: {type(exc).__name__}: {exc}"
            values = []
            for i in range(n):  # isolate the samples it fails on
                cols = {k: [v[i]] for k, v in columns.items()}
                try:
                    values += _valid(fn([prompts[i]], [completions[i]], **cols), 1, label)
                except RewardError:
                    raise
                except Exception:
                    values.append(math.nan)
                    errors[label] = errors.get(label, 0) + 1
        per[label] = values
        skipped[label] = sum(1 for v in values if math.isnan(v)) - errors.get(label, 0)
    total = []
    for i in range(n):
        scored = [(w, per[label][i]) for label, w, _ in rewards if not math.isnan(per[label][i])]
        total.append(sum(w * v for w, v in scored) if scored else math.nan)
    return RewardScores(per, total, errors, skipped, first_error)
