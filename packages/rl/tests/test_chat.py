"""Chat templates: ids and assistant masks equal transformers' ``apply_chat_template`` (the oracle)."""

from __future__ import annotations

import json

import pytest
from plyx.rl import ChatTemplate, ChatTemplateError, load_chat_template, tokenize_sft
from plyx.rl._demo import CHATML, build_tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "add 2 40"}, {"role": "assistant", "content": "42"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"},
     {"role": "assistant", "content": "cba"}, {"role": "user", "content": "and xyz?"},
     {"role": "assistant", "content": "zyx"}],
    [{"role": "user", "content": "héllo — ünïcode ✓"}, {"role": "assistant", "content": "✓ ok\nline two"}],
]
# Qwen2-style: a default system turn and a raise_exception path; no generation tags
QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _hf(tok, template):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.inner, chat_template=template, eos_token=tok.eos_token)


@pytest.mark.parametrize("source", [CHATML, QWEN_LIKE], ids=["chatml-generation", "qwen-like"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [False, True])
def test_rendered_ids_equal_transformers(tok, source, conv, gen):
    messages = CONVERSATIONS[conv] if not gen else CONVERSATIONS[conv][:-1]
    ours = ChatTemplate(source, eos_token=tok.eos_token)
    text = ours.render(messages, add_generation_prompt=gen)
    hf = _hf(tok, source)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True)["input_ids"]
    assert tok.encode(text) == list(want)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_assistant_mask_equals_transformers_generation_mask(tok, tmp_path, conv):
    """With {% generation %} blocks, our SFT loss mask is transformers' ``assistant_masks`` token for token."""
    messages = CONVERSATIONS[conv]
    hf = _hf(tok, CHATML)
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    ex = tokenize_sft(data, tok, ChatTemplate(CHATML), max_length=512).examples[0]
    assert list(ex.ids) == list(out["input_ids"])
    assert [int(m) for m in ex.loss_mask] == list(out["assistant_masks"])
    assert sum(ex.loss_mask) > 0


def test_prefix_spans_cover_assistant_content_and_end_of_turn(tok, tmp_path):
    """Without generation tags the span of turn i is render(m[:i+1]) minus render(m[:i], generation prompt)."""
    messages = CONVERSATIONS[1]
    template = ChatTemplate(QWEN_LIKE)
    rendered = template.render_with_spans(messages)
    pieces = [rendered.text[a:b] for a, b in rendered.spans]
    assert pieces == ["cba<|im_end|>\n", "zyx<|im_end|>\n"]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    ex = tokenize_sft(data, tok, template, max_length=512).examples[0]
    masked = tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])
    assert masked == "cba<|im_end|>\nzyx<|im_end|>\n"
    everything = tokenize_sft(data, tok, template, max_length=512, assistant_only_loss=False).examples[0]
    assert all(everything.loss_mask)


def test_template_errors_are_clear(tmp_path):
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate(QWEN_LIKE).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate("{% for m in messages %}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="has no chat template.*chat_template"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ 'D' }}"}]}))
    assert load_chat_template(tmp_path).render([]) == "D"
