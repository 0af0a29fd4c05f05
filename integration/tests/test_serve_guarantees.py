"""Scenario: guarantees that hold under attack, through a real server (serve + safety + governance).

- A streamed response never leaks a span the whole-text pass blocks, even when the span is longer
  than the rule's hold-back bound: a regex rule with ``max_len = 8`` on a pattern the model's output
  matches only after ~30 characters (four `` villain`` tokens) blocks the stream without one
  `` villain`` reaching the client.
- With ``PLYX_SERVE_RECEIPTS`` set, plyx-governance's ``plyx_on_response`` writes one receipt per
  response with the request's decoding settings and digests (never the text).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("plyx.safety")
pytest.importorskip("plyx.governance")
pytest.importorskip("uvicorn")

POLICY = """\
version = 2
name = "long-spans"

[[output]]
id = "no-villain-chant"
detector = "regex"
action = "block"
options = { patterns = ["(?: villain){4}"], max_len = 8 }
"""
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    """(openai client, app) of ``plyx serve CKPT --guardrail-policy long-spans.toml`` on loopback."""
    import torch
    from plyx.serve.server import build_server, serve_in_thread
    from plyx.specs.config.serve import ServeConfig
    from tokenizers import Tokenizer

    policy = tmp_path_factory.mktemp("policy") / "long-spans.toml"
    policy.write_text(POLICY)
    cfg = ServeConfig(model=str(trained.checkpoint), served_name="tiny", device="cpu", dtype="float32",
                      max_batch_size=2, max_batch_tokens=128, guardrail_policy=str(policy))
    app = build_server(cfg, chat_template="plain")
    app.state.plyx_test_tokenizer = Tokenizer.from_file(str(trained.checkpoint / "tokenizer.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serve_in_thread(app, timeout_graceful_shutdown=5) as running:
            yield openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=120), app
    finally:
        torch.set_num_threads(threads)


def _villain(app: Any) -> int:
    ids = app.state.plyx_test_tokenizer.encode(" villain").ids
    assert len(ids) == 1
    return ids[0]


def test_a_span_longer_than_the_hold_back_never_leaks_from_the_stream(served):
    client, app = served
    kwargs = dict(model="tiny", prompt="SPEAKER 1:\nThe", max_tokens=NEW_TOKENS, temperature=0,
                  logit_bias={str(_villain(app)): 100}, extra_body={"ignore_eos": True})
    chunks, finish = [], None
    for c in client.completions.create(stream=True, **kwargs):
        if c.choices:
            chunks.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
    assert not any("villain" in c for c in chunks), chunks  # not one token of the blocked span
    assert finish == "content_filter"
    whole = client.completions.create(**kwargs).choices[0]
    assert "villain" not in whole.text and whole.finish_reason == "content_filter"


def test_serve_receipts_record_decoding_settings_when_asked(served, tmp_path, monkeypatch):
    client, _ = served
    out = tmp_path / "receipts"
    monkeypatch.setenv("PLYX_SERVE_RECEIPTS", str(out))
    prompt = "SPEAKER 3:\nThe queen"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.0, seed=5, top_p=0.5,
                                      extra_body={"ignore_eos": True})
    lines = (out / "serve-receipts.jsonl").read_text().splitlines()
    assert len(lines) == 1
    receipt = json.loads(lines[0])
    assert receipt["schema"] == "plyx.governance.serve_receipt/1" and receipt["model"] == "tiny"
    assert {k: receipt["decoding"][k] for k in ("max_tokens", "temperature", "seed", "top_p")} == {
        "max_tokens": 4, "temperature": 0.0, "seed": 5, "top_p": 0.5}
    assert receipt["usage"]["completion_tokens"] == reply.usage.completion_tokens
    assert receipt["finish_reason"] == reply.choices[0].finish_reason
    assert "queen" not in lines[0] and receipt["prompt_sha256"].startswith("sha256:")


def test_the_checkpoint_receipt_is_signed_when_a_key_is_configured(trained, tmp_path, monkeypatch):
    """The checkpoint the session trained got a receipt from the hook; re-running the hook's writer with a
    signing key signs it, and the receipt verifies against that key only."""
    from plyx.governance import generate_keypair, verify_receipt
    from plyx.governance._release import write_checkpoint_records

    ckpt = tmp_path / "ckpt"
    import shutil

    shutil.copytree(trained.checkpoint, ckpt)
    private, public = generate_keypair(tmp_path / "keys" / "k")
    monkeypatch.setenv("PLYX_SIGNING_KEY", str(private))
    write_checkpoint_records(ckpt, 6, {"run_id": "integration", "techniques": {"precision": "fp32"}}, png=False)
    assert (ckpt / "RECEIPT.json.dsse.json").is_file()
    assert verify_receipt(ckpt / "RECEIPT.json", key=public).ok
    assert not verify_receipt(ckpt / "RECEIPT.json").ok  # signed, and no trusted key given
    assert Path(ckpt / "RECEIPT.json").read_text().count('"precision": "fp32"') == 1
