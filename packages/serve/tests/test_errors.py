"""Bad input is a clear ConfigError (field, value, fix) raised before any model compute."""

from __future__ import annotations

import pytest
from plyx.serve import BeamSearchParams, SamplingParams, StructuredOutput, beam_search, generate
from plyx.specs import ConfigError


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"top_p": 0.0}, "SamplingParams.top_p", "(0, 1]"),
        ({"top_p": 1.5}, "SamplingParams.top_p", "(0, 1]"),
        ({"max_new_tokens": 0}, "SamplingParams.max_new_tokens", ">= 1"),
        ({"max_new_tokens": -3}, "SamplingParams.max_new_tokens", ">= 1"),
        ({"temperature": -0.5}, "SamplingParams.temperature", ">= 0"),
        ({"top_k": -1}, "SamplingParams.top_k", ">= 0"),
        ({"min_p": 2.0}, "SamplingParams.min_p", "[0, 1]"),
        ({"typical_p": 0.0}, "SamplingParams.typical_p", "(0, 1]"),
        ({"repetition_penalty": 0.0}, "SamplingParams.repetition_penalty", "> 0"),
        ({"presence_penalty": 3.0}, "SamplingParams.presence_penalty", "[-2, 2]"),
        ({"logprobs": 50}, "SamplingParams.logprobs", "[0, 20]"),
        ({"n": 0}, "SamplingParams.n", ">= 1"),
        ({"min_tokens": 9, "max_new_tokens": 4}, "SamplingParams.min_tokens", "max_new_tokens"),
        ({"stop": ("",)}, "SamplingParams.stop", "non-empty"),
        ({"processors": (("x",),)}, "SamplingParams.processors[0]", "(name, kwargs)"),
        ({"top_p": "0.9"}, "SamplingParams.top_p", "must be <class 'float'>"),
        ({"max_new_tokens": 8.5}, "SamplingParams.max_new_tokens", "must be <class 'int'>"),
    ],
)
def test_sampling_params_validation(kwargs, field, words):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.path == field and words in str(err) and err.fix, str(err)


def test_unknown_field_and_structured_and_beam_params():
    with pytest.raises(TypeError, match="top_pp"):
        SamplingParams(top_pp=0.5)  # msgspec: unknown keyword
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ConfigError, match="exactly one"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(ConfigError, match="num_return_sequences"):
        BeamSearchParams(num_beams=2, num_return_sequences=3)
    with pytest.raises(ConfigError, match="early_stopping"):
        BeamSearchParams(early_stopping="sometimes")


def _no_compute(counting, model, call):
    wrapped = counting(model)
    with pytest.raises(ConfigError) as info:
        call(wrapped)
    assert wrapped.calls == 0, "the error must come before any forward pass"
    return info.value


def test_prompt_longer_than_context(make_model, counting):
    model = make_model(max_seq_len=16)
    err = _no_compute(counting, model, lambda m: generate(m, [[1, 2], list(range(1, 17))],
                                                           SamplingParams(max_new_tokens=4)))
    assert err.path == "prompts[1]" and "context is 16" in str(err) and "15" in err.fix
    err = _no_compute(counting, model, lambda m: beam_search(m, [list(range(1, 20))], BeamSearchParams()))
    assert err.path == "prompts[0]"


def test_bad_prompts(make_model, counting):
    model = make_model()
    assert _no_compute(counting, model, lambda m: generate(m, [[1], []])).path == "prompts[1]"
    assert _no_compute(counting, model, lambda m: generate(m, [[1, 999]])).path == "prompts[0]"
    assert _no_compute(counting, model, lambda m: generate(m, ["text"])).path == "prompts[0]"  # no tokenizer
    assert _no_compute(counting, model, lambda m: generate(m, [])).path == "prompts"
    err = _no_compute(counting, model, lambda m: generate(m, [[1], [2]], [SamplingParams()] * 3))
    assert err.path == "params"


@pytest.mark.parametrize(
    "structured, field, words",
    [
        (StructuredOutput(json_schema={"type": "strin"}), "json_schema", "invalid JSON Schema"),
        (StructuredOutput(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "json_schema", "minimum"),
        (StructuredOutput(json_schema='{"type": '), "json_schema", "not valid JSON"),
        (StructuredOutput(regex="[a-z"), "regex", "does not compile"),
        (StructuredOutput(regex="(ab"), "regex", "does not compile"),
        (StructuredOutput(grammar="root ::= "), "grammar", "does not compile"),
    ],
)
def test_invalid_constraints(tok_model, tokenizer, counting, structured, field, words):
    def call(m):
        return generate(m, ["hi"], SamplingParams(structured=structured), tokenizer=tokenizer)

    wrapped = counting(tok_model)
    with pytest.raises(ConfigError) as info:
        call(wrapped)
    assert wrapped.calls == 0
    assert field in str(info.value) and words in str(info.value), str(info.value)


def test_structured_and_stop_need_a_tokenizer(make_model, counting):
    model = make_model()
    err = _no_compute(counting, model, lambda m: generate(m, [[1]], SamplingParams(stop=("x",))))
    assert err.path == "params.stop" and "tokenizer" in str(err)
    err = _no_compute(counting, model, lambda m: generate(m, [[1]], SamplingParams(
        structured=StructuredOutput(regex="a+"))))
    assert err.path == "params.structured"


def test_draft_model_with_another_vocabulary(make_model, counting):
    target = make_model(vocab=128)
    draft = make_model(vocab=96, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1)
    err = _no_compute(counting, target, lambda m: generate(m, [[1, 2]], draft_model=draft))
    assert err.path == "draft_model" and "96" in str(err) and "128" in str(err)
    same = make_model(vocab=128, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1)
    err = _no_compute(counting, target, lambda m: generate(m, [[1, 2]], SamplingParams(repetition_penalty=1.2),
                                                           draft_model=same))
    assert err.path == "params[0].repetition_penalty"
    err = _no_compute(counting, target, lambda m: generate(m, [[1, 2]], draft_model=same, num_speculative_tokens=0))
    assert err.path == "num_speculative_tokens"


def test_unknown_plugin_names_and_cache_kind(make_model, counting):
    model = make_model()
    err = _no_compute(counting, model, lambda m: generate(m, [[1]], SamplingParams(processors=(("nope", {}),))))
    assert "not found" in str(err) and "top_p" in err.fix
    err = _no_compute(counting, model, lambda m: generate(m, [[1]], SamplingParams(sampler="nope")))
    assert err.path == "params.sampler"
    err = _no_compute(counting, model, lambda m: generate(m, [[1]], cache="ringbuffer"))
    assert err.path == "cache" and "paged" in err.fix
