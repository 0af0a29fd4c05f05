"""Request translation and chat templates, without a server."""

from __future__ import annotations

import json

import msgspec
import pytest
from plyx.serve.server import BUILTIN_TEMPLATES, APIError, ChatTemplate, load_chat_template
from plyx.serve.server._errors import from_validation_error
from plyx.serve.server._protocol import ChatCompletionRequest, CompletionRequest, sampling_params


def decode(kind, **body):
    return msgspec.json.decode(json.dumps(body).encode(), type=kind)


def test_openai_fields_map_to_sampling_params():
    req = decode(CompletionRequest, model="m", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, stop="##",
                 seed=3, logit_bias={"5": -100}, presence_penalty=0.5, n=2, top_k=4, ignore_eos=True)
    sp = sampling_params(req, max_tokens=req.max_tokens, default_max=16, logprobs=None)
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.stop, sp.seed, sp.n, sp.top_k) == (7, 0.5, 0.9, ("##",),
                                                                                               3, 2, 4)
    assert sp.logit_bias == {5: -100.0} and sp.presence_penalty == 0.5 and sp.ignore_eos


def test_response_format_becomes_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = decode(ChatCompletionRequest, model="m", messages=[], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    sp = sampling_params(req, max_tokens=None, default_max=8, logprobs=None)
    assert sp.structured.json_schema == schema
    req = decode(ChatCompletionRequest, model="m", messages=[], response_format={"type": "json_object"})
    # OpenAI's JSON mode is an object, not any JSON value
    assert sampling_params(req, max_tokens=None, default_max=8, logprobs=None).structured.json_schema == {
        "type": "object"}
    req = decode(ChatCompletionRequest, model="m", messages=[], response_format={"type": "json_schema"})
    with pytest.raises(APIError) as e:
        sampling_params(req, max_tokens=None, default_max=8, logprobs=None)
    assert e.value.status == 400 and e.value.param == "response_format.json_schema"


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3.0}, "temperature"), ({"n": 20}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"top_p": 0.0}, "top_p"), ({"min_tokens": 99}, "min_tokens"),
])
def test_bad_values_name_the_field(body, param):
    req = decode(CompletionRequest, model="m", prompt="x", **body)
    with pytest.raises(APIError) as e:
        sampling_params(req, max_tokens=req.max_tokens, default_max=16, logprobs=None)
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_validation_errors_name_the_field():
    with pytest.raises(msgspec.ValidationError) as e:
        decode(CompletionRequest, model="m", prompt="x", max_tokens="ten")
    err = from_validation_error(e.value)
    assert err.param == "max_tokens" and err.status == 400
    with pytest.raises(msgspec.ValidationError) as e:
        decode(CompletionRequest, model="m", prompt="x", wat=1)
    assert from_validation_error(e.value).message == "Unrecognized request argument supplied: wat"


def test_chat_templates(tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert ChatTemplate(BUILTIN_TEMPLATES["chatml"]).render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]"
                                                          "{% endfor %}{{ eos_token }}"}]}))
    t = load_chat_template(tmp_path)
    assert t.render(msgs) == "<s>[S][U]</s>"
    assert load_chat_template(tmp_path, "plain").render(msgs, add_generation_prompt=False) == "system: S\nuser: U\n"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_chat_template(tmp_path).render(msgs) == "2"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="builtin"):
        load_chat_template(None, "no-such-template")
    bad = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(ValueError, match="only user"):
        bad.render(msgs)
