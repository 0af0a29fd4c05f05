"""Data: record kinds, masks, packing across document boundaries, and every bad-input path of the issue."""

from __future__ import annotations

import json

import pytest
import torch
from plyx.rl import (
    ChatTemplate,
    DataError,
    collate_sft,
    completion_rows,
    pack_sft,
    token_logps,
    tokenize_kto,
    tokenize_pairs,
    tokenize_sft,
)
from plyx.rl._data import collate_packed
from plyx.rl._demo import CHATML, build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _conv(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_malformed_jsonl_names_the_line(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [_conv("a", "b"), "", '{"messages": [', _conv("c", "d")])
    with pytest.raises(DataError, match=r"d\.jsonl:3: malformed JSON"):
        tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=64)
    _jsonl(path, [_conv("a", "b"), "[1, 2]"])
    with pytest.raises(DataError, match=r":2: expected a JSON object"):
        tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=64)
    _jsonl(path, [{"prompt": "x", "chosen": "y"}])
    with pytest.raises(DataError, match=r":1: missing field 'rejected'"):
        tokenize_pairs(path, tok, None, max_length=64)
    with pytest.raises(DataError, match="does not exist"):
        tokenize_sft(tmp_path / "nope.jsonl", tok, None, max_length=64)


def test_no_assistant_turn_is_skipped_and_counted_or_an_error_when_strict(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [_conv("q1", "a1"), {"messages": [{"role": "user", "content": "q2"}]},
                                        _conv("q3", "a3")])
    data = tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=64)
    assert data.report.kept == 2 and data.report.skipped == {"no_assistant_turn": 1}
    assert data.report.first_skips == [(2, "no_assistant_turn")]
    assert "1 no_assistant_turn" in data.report.summary()
    with pytest.raises(DataError, match=r":2: record skipped \(no_assistant_turn\).*--strict"):
        tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=64, strict=True)


def test_conversation_without_a_template_is_a_clear_error(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [_conv("q", "a")])
    with pytest.raises(DataError, match=r":1: a conversation needs a chat template.*chat_template"):
        tokenize_sft(path, tok, None, max_length=64)


def test_chosen_equal_rejected_is_skipped_or_strict_error(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p ", "chosen": "a", "rejected": "b"},
                                        {"prompt": "p ", "chosen": "same", "rejected": "same"}])
    data = tokenize_pairs(path, tok, None, max_length=64)
    assert data.report.kept == 1 and data.report.skipped == {"chosen_equals_rejected": 1}
    with pytest.raises(DataError, match=r":2: chosen and rejected are the same"):
        tokenize_pairs(path, tok, None, max_length=64, strict=True)


def test_truncation_policies(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p" * 10, "completion": "c" * 10}, {"text": "short"}])
    data = tokenize_sft(path, tok, None, max_length=12, truncation="skip")
    assert data.report.kept == 1 and data.report.skipped == {"too_long": 1}
    with pytest.raises(DataError, match=r":1: 21 tokens exceed max_length 12.*truncation"):
        tokenize_sft(path, tok, None, max_length=12, truncation="error")
    data = tokenize_sft(path, tok, None, max_length=12, truncation="truncate")
    assert data.report.kept == 2 and data.report.truncated == 1 and len(data.examples[0].ids) == 12
    pairs = _jsonl(tmp_path / "p.jsonl", [{"prompt": "p" * 20, "chosen": "yes", "rejected": "no"}])
    fitted = tokenize_pairs(pairs, tok, None, max_length=10, truncation="truncate").examples[0]
    assert len(fitted.prompt) + len(fitted.chosen) <= 10 and fitted.chosen == tuple(tok.encode("yes")) + (tok.eos_id,)
    with pytest.raises(DataError, match="no usable example"):
        tokenize_pairs(pairs, tok, None, max_length=10, truncation="skip")


def test_kto_needs_both_labels(tok, tmp_path):
    path = _jsonl(tmp_path / "k.jsonl", [{"prompt": "p", "completion": "a", "label": True}])
    with pytest.raises(DataError, match="every KTO example is desirable"):
        tokenize_kto(path, tok, None, max_length=32)
    _jsonl(path, [{"prompt": "p", "completion": "a", "label": "yes"}])
    with pytest.raises(DataError, match="'label' must be bool"):
        tokenize_kto(path, tok, None, max_length=32)


def test_completion_only_masks_the_prompt(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "add 1 2 = ", "completion": "3"},
                                        {"prompt": [{"role": "user", "content": "add 1 2"}], "completion": "3"}])
    plain, conv = tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=64).examples
    assert tok.decode([i for i, m in zip(plain.ids, plain.loss_mask) if m]) == "3" + tok.eos_token
    assert tok.decode([i for i, m in zip(conv.ids, conv.loss_mask) if m]) == "3<|im_end|>\n"
    batch = collate_sft([plain], pad_id=tok.eos_id)
    want = [-100] * len(plain.ids)
    first = plain.loss_mask.index(True)
    for t in range(first - 1, len(plain.ids) - 1):
        want[t] = plain.ids[t + 1]
    assert batch.targets[0].tolist() == want


def _tiny_model(vocab=320):
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(arch="llama", vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                     max_seq_len=64))


def test_token_logps_equal_a_float64_log_softmax(tok):
    model = _tiny_model()
    batch = completion_rows([[5, 6, 7], [8]], [[9, 10, 0], [11, 12, 13, 0]], pad_id=0)
    got, mask = token_logps(model, batch)
    with torch.no_grad():
        logits = model(batch.input_ids).double()  # (B, T, V)
    ref = torch.log_softmax(logits, -1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
    ref = ref.masked_fill(batch.targets == -100, 0.0)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert mask.sum(-1).tolist() == [3, 4]  # the completion's tokens, end token included


def test_packed_rows_keep_documents_apart(tok, tmp_path):
    """Each document's log-probs in a packed row equal its log-probs alone: attention stops at boundaries."""
    path = _jsonl(tmp_path / "d.jsonl", [_conv("add 1 2", "3"), _conv("reverse abc", "cba"), _conv("sort 3 1", "1 3")])
    examples = tokenize_sft(path, tok, ChatTemplate(CHATML), max_length=128).examples
    rows = pack_sft(examples, 128, pad_id=tok.eos_id)
    assert len(rows) == 1 and rows[0][2][-1] == 2  # three documents in one row
    model = _tiny_model()
    packed, pmask = token_logps(model, collate_packed(rows, tok.eos_id))
    alone = [token_logps(model, collate_sft([e], tok.eos_id)) for e in examples]
    joined = torch.cat([lp[0][m[0]] for lp, m in alone])
    torch.testing.assert_close(packed[0][pmask[0]], joined, rtol=1e-5, atol=1e-5)
    assert int(pmask.sum()) == sum(int(m.sum()) for _, m in alone)
