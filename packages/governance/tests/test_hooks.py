"""The train/export hooks, called the way plyx-train and plyx-export call them (a fake emitter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plyx.governance import (
    GovernanceError,
    KeyPermissionError,
    generate_keypair,
    load_receipt,
    verify_receipt,
    verify_release,
)
from plyx.governance._files import digest_file


def emit_checkpoint_saved(hook, run: dict[str, Path], metadata: dict, step: int = 10) -> None:
    """What plyx-train does after writing a checkpoint directory atomically."""
    hook.plyx_on_checkpoint_saved(path=str(run["checkpoint"]), step=step, metadata=metadata)


def emit_export_written(hook, run: dict[str, Path], fmt: str = "onnx") -> None:
    """What plyx-export does after writing an export directory."""
    export = run["export"]
    hook.plyx_on_export_written(path=str(export), format=fmt, metadata={
        "artifacts": [str(export / "model.onnx"), str(export / "config.json")],
        "source": str(run["checkpoint"]), "config": {"opset": 17}, "name": "toy-llm"})


def test_checkpoint_hook_writes_receipt_and_lineage(hook, toy_run: dict[str, Path], checkpoint_metadata) -> None:
    emit_checkpoint_saved(hook, toy_run, checkpoint_metadata(toy_run))
    ckpt = toy_run["checkpoint"]
    receipt = load_receipt(ckpt / "RECEIPT.json")
    assert receipt["kind"] == "checkpoint" and receipt["step"] == 10 and receipt["run_id"] == "run-0001"
    assert receipt["seeds"] == {"python": 0, "torch": 2**63 + 11}
    assert receipt["config"]["model"] == {"d_model": 64, "n_layers": 2}
    assert receipt["metrics"]["loss"] == 2.75
    assert {i["name"]: i["sha256"] for i in receipt["inputs"]} == {
        "train_data": digest_file(toy_run["data"]), "tokenizer": digest_file(toy_run["tokenizer"])}
    assert {o["path"] for o in receipt["outputs"]} == {"model.safetensors", "model_card.json"}
    assert verify_receipt(ckpt / "RECEIPT.json").ok
    dot = (ckpt / "LINEAGE.dot").read_text(encoding="utf-8")
    assert "run run-0001" in dot and "checkpoint step 10" in dot and "tokenized by" in dot


def test_checkpoint_hook_defaults_outputs_to_the_directory_files(hook, toy_run: dict[str, Path],
                                                                 checkpoint_metadata) -> None:
    meta = checkpoint_metadata(toy_run)
    del meta["outputs"]
    hook.plyx_on_checkpoint_saved(path=str(toy_run["checkpoint"]), step=3, metadata=meta)
    hook.plyx_on_checkpoint_saved(path=str(toy_run["checkpoint"]), step=3, metadata=meta)  # again: own files skipped
    receipt = load_receipt(toy_run["checkpoint"] / "RECEIPT.json")
    assert {o["path"] for o in receipt["outputs"]} == {"model.safetensors", "model_card.json"}


def test_export_hook_writes_a_release_that_passes_the_gate(hook, toy_run: dict[str, Path],
                                                           checkpoint_metadata) -> None:
    emit_checkpoint_saved(hook, toy_run, checkpoint_metadata(toy_run))
    emit_export_written(hook, toy_run)
    export = toy_run["export"]
    for name in ("SBOM.spdx.json", "SBOM.cdx.json", "CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json",
                 "SIGNING_KEY.pub", "MODEL_CARD.md", "MODEL_CARD.json", "RECEIPT.json", "LINEAGE.dot"):
        assert (export / name).is_file(), name
    receipt = load_receipt(export / "RECEIPT.json")
    parent = load_receipt(toy_run["checkpoint"] / "RECEIPT.json")
    assert receipt["kind"] == "export" and receipt["format"] == "onnx" and receipt["parents"] == [parent["content_id"]]
    assert receipt["inputs"][0]["name"] == "source_checkpoint" and receipt["inputs"][0]["type"] == "dir"
    dot = (export / "LINEAGE.dot").read_text(encoding="utf-8")
    assert "exported as onnx" in dot and "tokenized by" in dot  # the whole chain, from both receipts
    listed = (export / "CHECKSUMS.sha256").read_text(encoding="utf-8")
    for name in ("model.onnx", "config.json", "SBOM.spdx.json", "RECEIPT.json", "MODEL_CARD.md", "LINEAGE.dot"):
        assert f"  {name}\n" in listed
    card = json.loads((export / "MODEL_CARD.json").read_text(encoding="utf-8"))
    assert card["name"] == "toy-llm" and card["quantitative_analyses"]["training"]["loss"] == 2.75
    # an ephemeral key proves integrity only, and verifying says so: it must be asked for
    assert ("CHECKSUMS.sha256.dsse.json", "trust") in {(p.artifact, p.check) for p in verify_release(export).problems}
    report = verify_release(export, integrity_only=True)
    assert report.ok, report.lines()
    assert any("ephemeral" in n for n in report.notes)  # no key configured: recorded as such


def test_export_hook_signs_with_the_configured_key(hook, toy_run: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    private, public = generate_keypair(toy_run["root"] / "keys" / "release.key")
    monkeypatch.setenv("PLYX_SIGNING_KEY", str(private))
    emit_export_written(hook, toy_run)
    report = verify_release(toy_run["export"], key=public)
    assert report.ok, report.lines()
    assert not any("ephemeral" in n for n in report.notes)
    other, other_pub = generate_keypair(toy_run["root"] / "keys" / "other.key")
    report = verify_release(toy_run["export"], key=other_pub)
    # both signatures the release carries (the checksums' and the receipt's) fail under another key
    assert sorted((p.artifact, p.check) for p in report.problems) == [("CHECKSUMS.sha256.dsse.json", "signature"),
                                                                      ("RECEIPT.json.dsse.json", "signature")]


@pytest.mark.skipif(os.name != "posix", reason="mode bits are POSIX")
def test_export_hook_refuses_a_loose_key(hook, toy_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    private, _ = generate_keypair(toy_run["root"] / "release.key")
    os.chmod(private, 0o644)
    monkeypatch.setenv("PLYX_SIGNING_KEY", str(private))
    with pytest.raises(KeyPermissionError):
        emit_export_written(hook, toy_run)
    assert not (toy_run["export"] / "CHECKSUMS.sha256").exists()


def test_required_key_without_one_is_an_error(hook, toy_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLYX_REQUIRE_SIGNING_KEY", "1")
    with pytest.raises(GovernanceError, match="PLYX_SIGNING_KEY"):
        emit_export_written(hook, toy_run)


def test_cli_is_contributed_through_the_hook(hook) -> None:
    commands = [c for impls in hook.plyx_cli_commands() for c in impls]
    assert [c.name for c in commands] == ["governance"]


def test_python_dash_m_entry_point(toy_run: dict[str, Path]) -> None:
    env = {**os.environ, "PLYX_PLUGINS": "governance"}
    done = subprocess.run([sys.executable, "-m", "plyx.governance", "keygen", "--out", str(toy_run["root"] / "k")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "plyx.governance", "verify", str(toy_run["export"])],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert "FAIL CHECKSUMS.sha256 [missing]" in done.stdout and "FAIL SBOM.spdx.json [missing]" in done.stdout
