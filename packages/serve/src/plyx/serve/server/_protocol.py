"""Request bodies of the OpenAI API (and vLLM's extras), and their translation to ``SamplingParams``.

Bodies are decoded by msgspec with unknown fields rejected, as OpenAI does
("Unrecognized request argument supplied: X"); type errors name the field.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from plyx.serve._params import BeamSearchParams, SamplingParams, StructuredOutput
from plyx.serve.server._errors import APIError, from_config_error
from plyx.specs.errors import ConfigError

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "LoadLoraRequest",
    "TokenizeRequest",
    "UnloadLoraRequest",
    "best_of_params",
    "sampling_params",
]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: Union[dict[str, Any], None] = None
    description: Union[str, None] = None
    strict: Union[bool, None] = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Union[JsonSchemaSpec, None] = None


class FunctionSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One entry of ``tools`` (OpenAI's chat tools: functions only); unset fields stay out of the template."""

    type: Literal["function"]
    function: FunctionSpec


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    model: str
    max_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    n: int = 1
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Union[dict[str, float], None] = None
    user: Union[str, None] = None
    seed: Union[int, None] = None
    response_format: Union[ResponseFormat, None] = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Union[list[int], None] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``."""

    prompt: Union[str, list[Any]]
    """Text, token ids, or a list of either (checked by the handler: msgspec unions allow one array type)."""
    logprobs: Union[int, None] = None
    echo: bool = False
    best_of: Union[int, None] = None
    """Sequences computed per prompt (>= n); the ``n`` best are returned (OpenAI's legacy API)."""
    suffix: Union[str, None] = None
    # vLLM's beam-search extras
    use_beam_search: bool = False
    """Beam search with ``best_of`` (default ``n``) beams; the ``n`` best hypotheses are returned."""
    length_penalty: float = 1.0
    """A hypothesis scores sum_logprobs / length ** length_penalty (beam search)."""
    early_stopping: Union[bool, str] = False
    """Beam search: True, False or "never" (transformers' meanings)."""


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None
    chat_template: Union[str, None] = None
    add_generation_prompt: bool = True
    tools: Union[list[ToolSpec], None] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    """``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: Union[bool, None] = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /tokenize``: ``prompt`` text, or chat ``messages`` rendered by the chat template."""

    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[list[dict[str, Any]], None] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/load_lora_adapter`` (vLLM's endpoint)."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: Union[str, None] = None


#: what ``response_format={"type": "json_object"}`` constrains the reply to
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

#: integers are int64, as vLLM's and the OpenAI API's (seeds too: completion i of n seeds with seed + i < 2^64)
_SEED_LIMIT = 2**63


def _structured(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        # OpenAI's JSON mode answers with an object; xgrammar's builtin JSON grammar allows any value
        # (an array, a bare number), so the server asks for the schema of an object instead
        return StructuredOutput(json_schema=JSON_OBJECT_SCHEMA)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema (a JSON Schema object)",
                       param="response_format.json_schema", code="invalid_value")
    return StructuredOutput(json_schema=fmt.json_schema.schema)


#: most sequences one prompt of a completions request computes (``best_of``, beams included)
MAX_BEST_OF = 16

#: sampling fields a beam search has no use for: (field, its default); a request setting one is refused
_NOT_FOR_BEAMS = (("stop", None), ("response_format", None), ("logit_bias", None), ("presence_penalty", 0.0),
                  ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("top_p", None), ("top_k", 0),
                  ("min_p", 0.0), ("min_tokens", 0), ("ignore_eos", False))  # a seed is harmless: no draw


def best_of_params(req: CompletionRequest, params: SamplingParams) -> tuple[SamplingParams | BeamSearchParams, int]:
    """The engine parameters of a completions request's ``best_of`` and ``use_beam_search``, and how many
    sequences each prompt computes.

    ``use_beam_search``: a beam search of ``best_of`` beams (default ``n``) whose ``n`` best hypotheses are the
    choices; ``best_of > n`` without it: ``best_of`` samples, ranked by cumulative log-probability (the server
    keeps the ``n`` best). Neither can stream: the ``n`` best are known only when every sequence ended (a 400
    says so, as vLLM's). A bad combination is a 400 naming the field.
    """
    best_of = req.n if req.best_of is None else req.best_of
    if not req.n <= best_of <= MAX_BEST_OF:
        raise APIError(400, f"best_of must be in [n={req.n}, {MAX_BEST_OF}] (got {best_of}): the n best of best_of "
                       "sequences are returned", param="best_of", code="invalid_value")
    if req.stream and (req.use_beam_search or best_of > req.n):
        what = "use_beam_search" if req.use_beam_search else "best_of"
        raise APIError(400, f"{what} cannot be streamed: the n best sequences are known only when all of them "
                       "ended; send stream=false", param="stream", code="unsupported_parameter")
    if not req.use_beam_search:
        if best_of == req.n:
            return params, best_of
        # the ranking reads every sample's cumulative log-probability: computed even when not returned
        lp = params.logprobs if params.logprobs is not None else 0
        return msgspec.structs.replace(params, n=best_of, logprobs=lp), best_of
    if req.temperature not in (None, 0.0):
        raise APIError(400, f"beam search is deterministic: leave temperature out or 0 (got {req.temperature})",
                       param="temperature", code="invalid_value")
    for name, default in _NOT_FOR_BEAMS:
        if getattr(req, name) != default:
            raise APIError(400, f"`{name}` does not apply to beam search (it stops on EOS, stop_token_ids and "
                           "max_tokens, and scores raw log-probabilities); leave it out or use_beam_search=false",
                           param=name, code="unsupported_parameter")
    if req.logprobs not in (None, 0):
        raise APIError(400, f"beam search reports each chosen token's log-probability (logprobs=0), not the top "
                       f"alternatives (got logprobs={req.logprobs})", param="logprobs", code="invalid_value")
    try:
        beams = BeamSearchParams(num_beams=best_of, max_new_tokens=params.max_new_tokens,
                                 num_return_sequences=req.n, length_penalty=req.length_penalty,
                                 early_stopping=req.early_stopping, stop_token_ids=params.stop_token_ids,
                                 logprobs=req.logprobs is not None)
    except ConfigError as exc:
        raise from_config_error(exc) from None
    return beams, best_of


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                    default_max: int, logprobs: int | None) -> SamplingParams:
    """The ``SamplingParams`` of a request; a bad value is a 400 ``APIError`` naming the request field."""
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens}); ask for a positive number of tokens",
                       param="max_tokens", code="invalid_value")
    if not 1 <= req.n <= 16:
        raise APIError(400, f"n must be in [1, 16] (got {req.n})", param="n", code="invalid_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 4:
        raise APIError(400, f"at most 4 stop sequences are allowed (got {len(stop)})", param="stop")
    try:
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias",
                       code="invalid_value") from None
    if any(not -100 <= v <= 100 for v in bias.values()):
        raise APIError(400, "logit_bias values must be in [-100, 100]", param="logit_bias", code="invalid_value")
    for f in msgspec.structs.fields(req):  # JSON integers are unbounded; the engine's tensors are int64
        v = getattr(req, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and not -_SEED_LIMIT <= v < _SEED_LIMIT and f.name != "seed":
            raise APIError(400, f"{f.name} must fit a 64-bit integer (got {v}); pass a smaller number",
                           param=f.name, code="invalid_value")
    if req.seed is not None and not 0 <= req.seed < _SEED_LIMIT:
        raise APIError(400, f"seed must be in [0, 2^63 - 1] (got {req.seed}); pass a smaller non-negative integer",
                       param="seed", code="invalid_value")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2] (got {temperature})", param="temperature",
                       code="invalid_value")
    try:
        return SamplingParams(
            n=req.n,
            max_new_tokens=max_tokens if max_tokens is not None else default_max,
            min_tokens=req.min_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias or None,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            seed=req.seed,
            logprobs=logprobs,
            structured=_structured(req.response_format),
            skip_special_tokens=req.skip_special_tokens,
        )
    except ConfigError as exc:
        raise from_config_error(exc) from None
