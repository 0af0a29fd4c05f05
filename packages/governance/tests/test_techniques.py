"""Receipts record the techniques that produced an artifact, can be signed, and serve-side receipts are opt-in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from plyx.governance import GovernanceError, generate_keypair, load_receipt, verify_receipt, verify_release
from plyx.governance._release import write_checkpoint_records, write_release
from plyx.specs.payloads import CheckpointPayload, ExportPayload, KernelChoice, Techniques

TECHNIQUES = Techniques(
    kernels=(KernelChoice(op="rmsnorm", implementation="triton_rmsnorm", distribution="plyx-kernel", version="1.3.0",
                          device="cuda", dtype="bfloat16"),
             KernelChoice(op="attention", implementation="sdpa", distribution="plyx-attn", version="1.2.0",
                          device="cuda", dtype="bfloat16")),
    precision="bf16-mixed", compile="inductor:default", attention_backend="paged", parallelism={"dp": 2},
    parallel_strategy="fsdp2", optimizer="adamw", data_fingerprint="sha256:" + "ab" * 32,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch):
    for name in ("PLYX_SIGNING_KEY", "PLYX_TRUSTED_KEYS", "PLYX_SERVE_RECEIPTS"):
        monkeypatch.delenv(name, raising=False)


def _ckpt(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(os.urandom(256))
    return ckpt


@pytest.mark.parametrize("as_struct", [True, False])
def test_a_checkpoint_receipt_records_every_technique(tmp_path, as_struct):
    ckpt = _ckpt(tmp_path)
    payload = CheckpointPayload(writer="save_checkpoint", run_id="r1", techniques=TECHNIQUES)
    if not as_struct:
        import msgspec

        payload = msgspec.to_builtins(payload)  # what an emitter that speaks dicts sends
    write_checkpoint_records(ckpt, 3, payload, png=False)
    receipt = load_receipt(ckpt / "RECEIPT.json")
    t = receipt["techniques"]
    assert t["kernels"][0] == {"op": "rmsnorm", "implementation": "triton_rmsnorm", "distribution": "plyx-kernel",
                               "version": "1.3.0", "device": "cuda", "dtype": "bfloat16"}
    assert (t["precision"], t["compile"], t["attention_backend"], t["parallelism"], t["parallel_strategy"],
            t["optimizer"]) == ("bf16-mixed", "inductor:default", "paged", {"dp": 2}, "fsdp2", "adamw")
    assert t["data_fingerprint"].startswith("sha256:") and receipt["writer"] == "save_checkpoint"
    assert verify_receipt(ckpt / "RECEIPT.json").ok  # the content id covers the techniques


def test_techniques_that_do_not_fit_the_contract_are_refused(tmp_path):
    ckpt = _ckpt(tmp_path)
    with pytest.raises(GovernanceError, match="techniques"):
        write_checkpoint_records(ckpt, 1, {"techniques": {"kernels": [{"op": "rmsnorm"}]}}, png=False)
    with pytest.raises(GovernanceError, match="precison"):
        write_checkpoint_records(ckpt, 1, {"techniques": {"precison": "bf16"}}, png=False)


def test_checkpoint_receipts_are_signed_with_the_configured_key(tmp_path, monkeypatch, plyx):
    private, public = generate_keypair(tmp_path / "keys" / "k")
    monkeypatch.setenv("PLYX_SIGNING_KEY", str(private))
    ckpt = _ckpt(tmp_path)
    write_checkpoint_records(ckpt, 7, CheckpointPayload(run_id="r", techniques=TECHNIQUES), png=False)
    receipt = ckpt / "RECEIPT.json"
    assert (ckpt / "RECEIPT.json.dsse.json").is_file()
    assert verify_receipt(receipt, key=public).ok  # the envelope beside it is not an output of the checkpoint
    assert plyx(["governance", "receipt", "verify", str(receipt), "--key", str(public)]) == 0
    assert plyx(["governance", "receipt", "verify", str(receipt)]) == 1  # signed, but no trusted key given
    _, other = generate_keypair(tmp_path / "keys" / "other")
    assert ("RECEIPT.json.dsse.json", "signature") in {(p.artifact, p.check) for p in
                                                       verify_receipt(receipt, key=other).problems}
    doc = json.loads(receipt.read_text())
    doc["techniques"]["precision"] = "fp32"  # a rewritten history
    receipt.write_text(json.dumps(doc))
    found = {(p.artifact, p.check) for p in verify_receipt(receipt, key=public).problems}
    assert found == {("RECEIPT.json", "receipt"), ("RECEIPT.json", "signature")}


def test_a_release_signs_its_receipt_and_the_gate_checks_it(tmp_path, plyx):
    private, public = generate_keypair(tmp_path / "keys" / "release.key")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(os.urandom(512))
    write_release(export, format="onnx", key=private, png=False,
                  metadata=ExportPayload(name="toy", card={"license": "MIT"}, techniques=TECHNIQUES))
    receipt = load_receipt(export / "RECEIPT.json")
    assert receipt["techniques"]["kernels"][1]["implementation"] == "sdpa"
    card = json.loads((export / "MODEL_CARD.json").read_text())
    assert card["license"] == "MIT" and card["model_details"]["techniques"]["precision"] == "bf16-mixed"
    md = (export / "MODEL_CARD.md").read_text()
    assert "- Techniques: precision bf16-mixed" in md and "rmsnorm=triton_rmsnorm (plyx-kernel 1.3.0)" in md
    assert "RECEIPT.json.dsse.json" in (export / "CHECKSUMS.sha256").read_text()
    report = verify_release(export, key=public)
    assert report.ok and any("RECEIPT.json.dsse.json: Ed25519 signature valid" in p for p in report.passed)


def test_serve_receipts_are_opt_in_and_hold_decoding_settings_not_text(tmp_path, monkeypatch, hook):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "my card is 4111 1111 1111 1111"}],
               "temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 32, "prompt_text": "my card is 4111"}
    response = {"text": "noted", "finish_reason": "stop", "usage": {"prompt_tokens": 9, "completion_tokens": 2},
                "status": 200}
    context = {"request_id": "chatcmpl-1", "endpoint": "/v1/chat/completions", "client": "10.0.0.7",
               "techniques": {"precision": "bf16", "attention_backend": "paged"}}
    hook.plyx_on_response(request=request, response=response, context=context)
    assert not list(tmp_path.iterdir())  # off unless asked for
    monkeypatch.setenv("PLYX_SERVE_RECEIPTS", str(tmp_path / "receipts"))
    hook.plyx_on_response(request=request, response=response, context=context)
    hook.plyx_on_response(request={**request, "temperature": 0.0}, response=response, context=context)
    lines = (tmp_path / "receipts" / "serve-receipts.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["decoding"] == {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 32}
    assert second["decoding"]["temperature"] == 0.0 and first["content_id"] != second["content_id"]
    assert first["techniques"]["attention_backend"] == "paged" and first["request_id"] == "chatcmpl-1"
    raw = "\n".join(lines)
    assert "4111" not in raw and "noted" not in raw and "10.0.0.7" not in raw  # digests only
    assert first["response_sha256"].startswith("sha256:")
