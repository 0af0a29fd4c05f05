"""Reproducibility receipts: contents, content id, replay."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from plyx.governance import content_id, load_receipt, make_receipt, verify_receipt, write_receipt
from plyx.governance._files import _CACHE, digest_file


def test_receipt_records_everything_and_replays(toy_run: dict[str, Path]) -> None:
    ckpt = toy_run["checkpoint"]
    receipt = make_receipt(base=ckpt, kind="checkpoint", outputs=[ckpt / "model.safetensors"],
                           inputs={"data": toy_run["data"], "tokenizer": toy_run["tokenizer"]},
                           config={"lr": 1e-3, "path": Path("x/y"), "dims": (1, 2)}, seeds={"torch": 2**64 - 1},
                           metrics={"loss": float("nan"), "ppl": 12.5}, run_id="r1", step=7,
                           accelerator={"kind": "cuda", "devices": [{"name": "H100"}]})
    assert receipt["content_id"] == content_id(receipt)
    for key in ("system", "accelerator", "python", "packages", "git", "config", "seeds", "inputs", "outputs"):
        assert key in receipt
    assert receipt["python"]["version"].count(".") == 2
    assert receipt["packages"]["plyx-governance"]
    assert receipt["git"] is None or set(receipt["git"]) == {"commit", "dirty"}
    assert receipt["config"] == {"lr": 1e-3, "path": "x/y", "dims": [1, 2]}
    assert receipt["metrics"]["loss"] == "NaN" and receipt["seeds"]["torch"] == 2**64 - 1
    assert receipt["inputs"][0] == {"name": "data", "path": "../../data/corpus.txt", "type": "file",
                                    "sha256": digest_file(toy_run["data"]), "size": toy_run["data"].stat().st_size}
    assert receipt["outputs"][0]["path"] == "model.safetensors"
    path = write_receipt(ckpt / "RECEIPT.json", receipt)
    loaded = load_receipt(path)
    assert loaded == receipt  # JSON round trip keeps floats and big ints exact, so the id still matches
    report = verify_receipt(path)
    assert report.ok, report.lines()
    assert any("model.safetensors: byte-equal" in line for line in report.passed)


def test_replay_names_each_changed_or_missing_artifact(toy_run: dict[str, Path]) -> None:
    ckpt = toy_run["checkpoint"]
    receipt = make_receipt(base=ckpt, outputs=[ckpt / "model.safetensors", ckpt],
                           inputs={"data": toy_run["data"], "tokenizer": toy_run["tokenizer"]})
    path = write_receipt(ckpt / "RECEIPT.json", receipt)
    assert verify_receipt(path).ok  # the directory digest ignores the receipt written into it
    blob = bytearray((ckpt / "model.safetensors").read_bytes())
    blob[100] ^= 0x01
    (ckpt / "model.safetensors").write_bytes(bytes(blob))
    toy_run["tokenizer"].unlink()
    report = verify_receipt(path)
    failed = {(p.artifact, p.check) for p in report.problems}
    assert failed == {("model.safetensors", "receipt"), (".", "receipt"), ("../../data/tokenizer.json", "receipt")}
    assert any("missing" in p.message for p in report.problems if "tokenizer" in p.artifact)


def test_edited_receipt_fails_its_content_id(toy_run: dict[str, Path]) -> None:
    ckpt = toy_run["checkpoint"]
    path = write_receipt(ckpt / "RECEIPT.json", make_receipt(base=ckpt, outputs=[ckpt / "model.safetensors"],
                                                              config={"lr": 0.001}))
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["config"]["lr"] = 0.002
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    report = verify_receipt(path)
    assert [(p.artifact, p.check) for p in report.problems] == [("RECEIPT.json", "receipt")]
    assert "edited" in report.problems[0].message
    # layout alone is not content: re-indenting the original keeps the id
    doc["config"]["lr"] = 0.001
    path.write_text(json.dumps(doc, indent=7, sort_keys=False), encoding="utf-8")
    assert verify_receipt(path).ok


def test_cli_receipt_and_replay(toy_run: dict[str, Path], plyx, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = toy_run["checkpoint"]
    meta = ckpt.parent / "meta.json"
    meta.write_text(json.dumps({"config": {"a": 1}, "seeds": [1, 2], "run_id": "cli",
                                "inputs": {"data": str(toy_run["data"])}}), encoding="utf-8")
    out = ckpt / "RECEIPT.json"
    assert plyx(["governance", "receipt", "--artifacts", str(ckpt / "model.safetensors"), "--metadata", str(meta),
                 "--input", f"tokenizer={toy_run['tokenizer']}", "--out", str(out)]) == 0
    receipt = load_receipt(out)
    assert [i["name"] for i in receipt["inputs"]] == ["data", "tokenizer"] and receipt["run_id"] == "cli"
    assert plyx(["governance", "receipt", "verify", str(out)]) == 0
    (ckpt / "model.safetensors").write_bytes(b"changed")
    capsys.readouterr()
    assert plyx(["governance", "receipt", "verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL model.safetensors [receipt]" in text and "ok   ../../data/corpus.txt" in text
    assert plyx(["governance", "receipt", "--out", str(out)]) == 2  # nothing to record


def test_not_a_receipt(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text('{"schema": "other"}', encoding="utf-8")
    report = verify_receipt(tmp_path / "r.json")
    assert not report.ok and "not a receipt" in report.problems[0].message


def test_input_digests_are_reused_only_while_the_file_is_unchanged(toy_run: dict[str, Path]) -> None:
    ckpt = toy_run["checkpoint"]
    first = make_receipt(base=ckpt, inputs={"data": toy_run["data"]})
    assert any(k[1] == os.path.abspath(toy_run["data"]) for k in _CACHE)
    again = make_receipt(base=ckpt, inputs={"data": toy_run["data"]})
    assert first["inputs"] == again["inputs"]
    toy_run["data"].write_text("a different corpus, a different size\n", encoding="utf-8")
    changed = make_receipt(base=ckpt, inputs={"data": toy_run["data"]})
    assert changed["inputs"][0]["sha256"] == digest_file(toy_run["data"]) != first["inputs"][0]["sha256"]


def test_paths_relative_within_a_run_tree_absolute_beyond(tmp_path: Path) -> None:
    from plyx.governance._receipt import stored_path

    base = tmp_path / "a" / "b" / "c" / "d"
    assert stored_path(base / "x.bin", base) == "x.bin"
    assert stored_path(tmp_path / "a" / "m.csv", base) == "../../../m.csv"
    far = tmp_path / "cache" / "data.bin"
    assert stored_path(far, base) == far.as_posix()
    far.parent.mkdir()
    far.write_bytes(b"d")
    base.mkdir(parents=True)
    receipt = make_receipt(base=base, inputs={"data": far})
    assert receipt["inputs"][0]["path"] == far.as_posix()
    assert verify_receipt(write_receipt(base / "RECEIPT.json", receipt)).ok  # absolute paths replay too
