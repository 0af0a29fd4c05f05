"""The frozen request structs of the serve ABI: ``SamplingParams``, ``StructuredOutput``, ``BeamSearchParams``.

Modelled on vLLM's ``SamplingParams`` and transformers' ``GenerationConfig``:
keyword-only, frozen, unknown keys rejected, every field documented, and every
out-of-range value a ``ConfigError`` (a ``ValueError``) that names the field,
the value, the expected form and the fix. Validation happens when the struct is
built, so a bad request fails before any compute.

New fields may be added in minor versions (with defaults that keep the old
behaviour); none is removed or renamed before 2.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
from plyx.specs.errors import ConfigError

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutput"]


def _err(owner: str, field: str, problem: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{owner}.{field}", problem, value=value, fix=fix)


def _check_types(obj: msgspec.Struct, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """msgspec checks types when decoding, not in ``__init__``: check the numeric fields here, like attrs'
    validators, so ``top_p="0.9"`` fails with the field's name instead of a comparison error."""
    owner = type(obj).__name__
    for name in ints:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _err(owner, name, f"'{name}' must be <class 'int'> (got {value!r} that is a {type(value)})",
                       value, "pass an integer")
    for name in floats:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _err(owner, name, f"'{name}' must be <class 'float'> (got {value!r} that is a {type(value)})",
                       value, "pass a number")


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A constraint on the generated text, enforced by the xgrammar engine. Set exactly one field.

    Example:
        >>> StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
        >>> StructuredOutput(regex=r"[a-z]+@[a-z]+\\.com")
        >>> StructuredOutput(choice=("yes", "no"))
    """

    json_schema: dict[str, Any] | str | None = None
    """A JSON Schema (dict or JSON text); the output is one JSON value valid against it."""
    json_object: bool = False
    """Any JSON value (OpenAI's ``response_format={"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF dialect, start rule ``root``)."""
    whitespace: bool = False
    """(json) allow free whitespace between JSON tokens; False emits compact JSON, which small
    models cannot pad endlessly with spaces."""

    def __post_init__(self) -> None:
        chosen = [
            name
            for name in ("json_schema", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(chosen) != 1:
            raise _err(
                "StructuredOutput",
                "json_schema|json_object|regex|choice|grammar",
                f"exactly one constraint must be set, {len(chosen)} were",
                chosen or None,
                "pass one of json_schema=, json_object=True, regex=, choice= or grammar=",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise _err(
                "StructuredOutput", "choice", "choice must be a non-empty tuple of non-empty strings",
                self.choice, 'pass e.g. choice=("yes", "no")',
            )


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How one request is decoded: the processors, the sampler, the stop rules and what is returned.

    Processors run in this order on the model's float32 logits: repetition,
    presence and frequency penalties, logit bias, banned tokens, min_tokens,
    structured output, plugin processors, then temperature, top-k, top-p,
    min-p and typical-p; the sampler picks the token (greedy when temperature
    is 0). The order is transformers' (penalties before warpers).

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64, stop=("\\n\\n",), seed=1)
    """

    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks (cache fork)."""
    max_new_tokens: int = 16
    """Most tokens generated per completion (>= 1); generation also stops at the model's context."""
    min_tokens: int = 0
    """Stop tokens (ids, EOS) are banned until this many tokens were generated."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 is greedy decoding (argmax, through the fused kernel)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]; 0 disables."""
    typical_p: float = 1.0
    """Locally typical sampling mass, in (0, 1]; 1 disables."""
    repetition_penalty: float = 1.0
    """CTRL penalty on every token of the prompt and output (> 0; 1 disables; > 1 discourages)."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty, subtracted once from tokens already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty, times the count of each token already generated, in [-2, 2]."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids (OpenAI ``logit_bias``; -100 effectively bans)."""
    banned_token_ids: tuple[int, ...] = ()
    """Token ids never generated."""
    stop: tuple[str, ...] = ()
    """Stop strings (need a tokenizer); the text ends before the first one found."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion, in addition to the EOS id."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (benchmarks)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string at the end of the text."""
    seed: int | None = None
    """Seed of this request's own random stream: the same seed gives the same tokens whatever else is
    in the batch. Completion i of n uses seed + i. None draws from generate's generator."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of its top ``logprobs`` alternatives
    (0: only the chosen token). Log-probabilities are of the model's distribution before processors."""
    prompt_logprobs: bool = False
    """Reserved for the engine (issue 8); must stay False here."""
    structured: StructuredOutput | None = None
    """Constrain the output with a JSON schema, regex, choice or grammar (needs a tokenizer)."""
    processors: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Extra logits processors by plugin name, with their factory keyword arguments:
    ``(("my_processor", {"strength": 2.0}),)``; found through the ``plyx_samplers`` hook."""
    sampler: str | None = None
    """Sampler by plugin name; None picks ``greedy`` (temperature 0) or ``multinomial``."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS...) out of the decoded text."""

    def __post_init__(self) -> None:
        o = "SamplingParams"
        _check_types(self, ("n", "max_new_tokens", "min_tokens", "top_k"),
                     ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty"))
        if self.n < 1:
            raise _err(o, "n", "n must be >= 1", self.n, "ask for at least one completion")
        if self.max_new_tokens < 1:
            raise _err(o, "max_new_tokens", "max_new_tokens must be >= 1", self.max_new_tokens,
                       "pass a positive number of tokens to generate")
        if self.min_tokens < 0 or self.min_tokens > self.max_new_tokens:
            raise _err(o, "min_tokens", f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}]",
                       self.min_tokens, "lower min_tokens or raise max_new_tokens")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise _err(o, "temperature", "temperature must be a finite number >= 0", self.temperature,
                       "use 0 for greedy decoding, 1 for the model's distribution")
        if self.top_k < 0:
            raise _err(o, "top_k", "top_k must be >= 0", self.top_k, "use 0 to disable top-k")
        if not (0 < self.top_p <= 1):
            raise _err(o, "top_p", "top_p must be in (0, 1]", self.top_p, "use 1.0 to disable nucleus sampling")
        if not (0 <= self.min_p <= 1):
            raise _err(o, "min_p", "min_p must be in [0, 1]", self.min_p, "use 0 to disable min-p")
        if not (0 < self.typical_p <= 1):
            raise _err(o, "typical_p", "typical_p must be in (0, 1]", self.typical_p, "use 1.0 to disable it")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise _err(o, "repetition_penalty", "repetition_penalty must be a finite number > 0",
                       self.repetition_penalty, "use 1.0 to disable it")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2 <= value <= 2):
                raise _err(o, name, f"{name} must be in [-2, 2]", value, "use 0 to disable it")
        for name in ("banned_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(self, name) if t < 0]
            if bad:
                raise _err(o, name, "token ids must be >= 0", bad, "pass ids from the tokenizer's vocabulary")
        if self.logit_bias is not None:
            bad = {k: v for k, v in self.logit_bias.items() if k < 0 or not math.isfinite(v)}
            if bad:
                raise _err(o, "logit_bias", "keys must be token ids >= 0 and values finite", bad,
                           "pass {token_id: bias} with -100 <= bias <= 100")
        if any(not s for s in self.stop):
            raise _err(o, "stop", "stop strings must be non-empty", self.stop, "remove the empty string")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise _err(o, "logprobs", "logprobs must be in [0, 20]", self.logprobs,
                       "ask for at most 20 alternatives, or None for no log-probabilities")
        if self.seed is not None and self.seed < 0:
            raise _err(o, "seed", "seed must be >= 0", self.seed, "pass a non-negative integer")
        if self.prompt_logprobs:
            raise _err(o, "prompt_logprobs", "prompt log-probabilities are not supported by generate()",
                       True, "leave prompt_logprobs False")
        for i, item in enumerate(self.processors):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], Mapping)):
                raise _err(o, f"processors[{i}]", "each processor is a (name, kwargs) pair", item,
                           'pass e.g. processors=(("my_processor", {"strength": 2.0}),)')

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature == 0.0


class BeamSearchParams(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Beam search as transformers' ``num_beams`` decoding: scores are summed log-probabilities.

    Example:
        >>> BeamSearchParams(num_beams=4, max_new_tokens=32, length_penalty=1.0, num_return_sequences=2)
    """

    num_beams: int = 4
    """Beams kept per prompt (>= 1)."""
    max_new_tokens: int = 16
    """Most tokens generated per beam (>= 1)."""
    length_penalty: float = 1.0
    """A finished hypothesis scores sum_logprobs / length ** length_penalty (length counts generated
    tokens); > 0 favours longer outputs, < 0 shorter ones."""
    early_stopping: bool | str = False
    """True: stop once num_beams hypotheses are finished; False: stop when no beam can still beat the
    worst kept one (heuristic); "never": the exact, slower check (transformers' semantics)."""
    num_return_sequences: int = 1
    """Hypotheses returned per prompt, best first (<= num_beams)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that finish a hypothesis, in addition to the EOS id."""
    logprobs: bool = False
    """Return the (raw) log-probability of each token of each returned hypothesis."""

    def __post_init__(self) -> None:
        o = "BeamSearchParams"
        _check_types(self, ("num_beams", "max_new_tokens", "num_return_sequences"), ("length_penalty",))
        if self.num_beams < 1:
            raise _err(o, "num_beams", "num_beams must be >= 1", self.num_beams, "use at least one beam")
        if self.max_new_tokens < 1:
            raise _err(o, "max_new_tokens", "max_new_tokens must be >= 1", self.max_new_tokens,
                       "pass a positive number of tokens to generate")
        if not (1 <= self.num_return_sequences <= self.num_beams):
            raise _err(o, "num_return_sequences", f"must be in [1, num_beams={self.num_beams}]",
                       self.num_return_sequences, "raise num_beams or return fewer sequences")
        if self.early_stopping not in (True, False, "never"):
            raise _err(o, "early_stopping", 'early_stopping must be True, False or "never"',
                       self.early_stopping, 'pass True, False or "never"')
        if not math.isfinite(self.length_penalty):
            raise _err(o, "length_penalty", "length_penalty must be finite", self.length_penalty, "use 1.0")
