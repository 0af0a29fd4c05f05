"""Structured output through xgrammar: random tiny models emit garbage unless constrained, and every
constrained output parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from plyx.serve import SamplingParams, StructuredOutput, generate

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y", "zz"]}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "ok", "tags", "kind"],
    "additionalProperties": False,
}


def _run(model, tokenizer, structured, n=6, temperature=1.0, seed=0, max_new_tokens=120):
    out = generate(model, ["hello"], SamplingParams(n=n, temperature=temperature, seed=seed, structured=structured,
                                                     max_new_tokens=max_new_tokens), tokenizer=tokenizer)
    return out[0].outputs


def test_unconstrained_random_model_is_not_json(tok_model, tokenizer):
    outs = generate(tok_model, ["hello"], SamplingParams(n=4, seed=0, max_new_tokens=40), tokenizer=tokenizer)[0].outputs
    for o in outs:
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_outputs_validate(tok_model, tokenizer, seed):
    for o in _run(tok_model, tokenizer, StructuredOutput(json_schema=SCHEMA), seed=seed):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_greedy_and_array_json_schemas(tok_model, tokenizer):
    (o,) = _run(tok_model, tokenizer, StructuredOutput(json_schema=json.dumps(SCHEMA)), n=1, temperature=0)
    jsonschema.validate(json.loads(o.text), SCHEMA)
    small = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}
    for o in _run(tok_model, tokenizer, StructuredOutput(json_schema=small), n=4, seed=5):
        jsonschema.validate(json.loads(o.text), small)


def test_regex_outputs_match(tok_model, tokenizer):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for o in _run(tok_model, tokenizer, StructuredOutput(regex=pattern), seed=2):
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text


def test_choice_outputs_are_choices(tok_model, tokenizer):
    choices = ("yes", "no", "maybe (later)")
    outs = _run(tok_model, tokenizer, StructuredOutput(choice=choices), n=12, seed=3)
    assert all(o.text in choices for o in outs), [o.text for o in outs]


def test_ebnf_grammar(tok_model, tokenizer):
    grammar = 'root ::= "[" num ("," num){0,3} "]"\nnum ::= [1-9] [0-9]?'
    for o in _run(tok_model, tokenizer, StructuredOutput(grammar=grammar), seed=4):
        assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?){0,3}\]", o.text), o.text


def test_mixed_batch_constrains_only_its_rows(tok_model, tokenizer):
    out = generate(tok_model, ["hello", "world"], [
        SamplingParams(seed=1, max_new_tokens=80, structured=StructuredOutput(choice=("alpha", "beta"))),
        SamplingParams(seed=1, max_new_tokens=10, ignore_eos=True),
    ], tokenizer=tokenizer)
    assert out[0].outputs[0].text in ("alpha", "beta")
    assert len(out[1].outputs[0].token_ids) == 10
