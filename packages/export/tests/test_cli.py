"""``plyx export``: a checkpoint on disk to a verified ONNX export, the hook fired with the right metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
import torch
from plyx.model import load_checkpoint, save_checkpoint
from plyx.specs.cli import main

TOKENIZER = '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}\n'


@pytest.fixture
def checkpoint(tmp_path: Path, tiny_config, random_model) -> Path:
    """A qwen3 checkpoint (QK-norm, tied embeddings) with a bundled tokenizer, as plyx-train writes it."""
    model = random_model(tiny_config(arch="qwen3", qk_norm=True, tie_embeddings=True, n_layers=1), seed=5)
    path = save_checkpoint(model, tmp_path / "ckpt", card_fields={"name": "tiny-qwen3", "tokenizer": "tokenizer.json"})
    (path / "tokenizer.json").write_text(TOKENIZER, encoding="utf-8")
    return path


def test_cli_exports_verifies_and_fires_the_hook(checkpoint: Path, tmp_path: Path, hook_recorder, capsys) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")

    # an existing, non-empty --out is refused before anything is loaded or written
    assert main(["export", str(checkpoint), "--format", "onnx", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "stale.txt" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["stale.txt"] and hook_recorder.calls == []

    assert main(["export", str(checkpoint), "--format", "onnx", "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert "model.onnx" in printed and "verified in onnxruntime" in printed and "FAIL" not in printed
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model.onnx", "plyx_export.json", "tokenizer.json"]  # stale.txt replaced

    (call,) = hook_recorder.calls
    meta: dict[str, Any] = call["metadata"]
    assert call["path"] == str(out.absolute()) and call["format"] == "onnx"
    assert sorted(meta["artifacts"]) == sorted(str(p.absolute()) for p in out.iterdir())
    assert meta["source"] == str(checkpoint.absolute())
    assert meta["name"] == "tiny-qwen3"
    model = load_checkpoint(checkpoint)
    assert meta["config"]["model"] == model.config.to_dict()
    assert meta["config"]["export"]["opset"] == 18 and meta["config"]["export"]["dtype"] == "float32"
    assert meta["verification"]["ok"] and len(meta["verification"]["checks"]) == 2
    json.dumps(meta)  # hook metadata must be plain JSON for receipts

    assert (out / "tokenizer.json").read_text(encoding="utf-8") == TOKENIZER
    hf = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert hf["model_type"] == "qwen3" and hf["tie_word_embeddings"] is True
    manifest = json.loads((out / "plyx_export.json").read_text(encoding="utf-8"))
    assert manifest["source"]["card"]["name"] == "tiny-qwen3" and manifest["model"] == model.config.to_dict()

    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(["logits"], {"input_ids": ids.numpy()})[0])
    with torch.no_grad():
        want = model(ids)
    assert float((got - want).abs().max()) <= 1e-4 + 1e-4 * float(want.abs().max())


def test_unknown_format_names_the_available_ones(checkpoint: Path, tmp_path: Path, capsys, only_export_plugins) -> None:
    assert main(["export", str(checkpoint), "--format", "tflite", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "'tflite' not found" in err and "available formats: gguf, hf, onnx" in err
    assert not (tmp_path / "x").exists()


def test_missing_checkpoint_is_named(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-run"
    assert main(["export", str(missing), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert not (tmp_path / "x").exists()


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "model_card.json" in err and "config.json" in err


def test_export_command_is_registered_with_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--format", "--out", "--force", "--seq-len", "--opset", "--dtype", "--no-verify", "--atol", "--rtol"):
        assert flag in text
