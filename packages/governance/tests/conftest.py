"""Fixtures: a fake emitter of the train/export hooks, a toy run on disk, release directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from plyx.specs import plugins


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch):
    """The real plugin manager, scanning entry points with only plyx-governance allowed.

    This is what plyx-train and plyx-export call (``get_plugin_manager().hook``);
    limiting the scan keeps other installed planes out of these tests.
    """
    monkeypatch.setenv("PLYX_PLUGINS", "governance")
    monkeypatch.delenv("PLYX_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("PLYX_SIGNING_KEY", raising=False)
    monkeypatch.delenv("PLYX_REQUIRE_SIGNING_KEY", raising=False)
    plugins.reset_plugins()
    pm = plugins.get_plugin_manager()
    assert pm.has_plugin("governance"), [r for r in plugins.plugin_report()]
    yield pm.hook
    plugins.reset_plugins()


@pytest.fixture
def toy_run(tmp_path: Path) -> dict[str, Path]:
    """A run directory as plyx-train would leave it: data, tokenizer, one checkpoint, one export."""
    rng = __import__("random").Random(0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("the quick brown fox\njumps over the lazy dog\n", encoding="utf-8")
    (data / "tokenizer.json").write_text('{"model": {"type": "BPE"}}', encoding="utf-8")
    ckpt = tmp_path / "run" / "step-00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    (ckpt / "model_card.json").write_text('{"schema": "model_card", "version": 1}', encoding="utf-8")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(bytes(rng.randrange(256) for _ in range(2048)))
    (export / "config.json").write_text('{"d_model": 64}', encoding="utf-8")
    return {"root": tmp_path, "data": data / "corpus.txt", "tokenizer": data / "tokenizer.json",
            "checkpoint": ckpt, "export": export}


@pytest.fixture
def checkpoint_metadata():
    """Builds hook metadata for a toy run (see ``_checkpoint_metadata``)."""
    return _checkpoint_metadata


def _checkpoint_metadata(run: dict[str, Path]) -> dict:
    """Hook metadata with every key plyx.specs.hookspecs documents for plyx_on_checkpoint_saved."""
    return {
        "config": {"model": {"d_model": 64, "n_layers": 2}, "optimizer": {"lr": 3e-4}},
        "seeds": {"python": 0, "torch": 2**63 + 11},  # 64-bit seeds stay exact
        "inputs": {"train_data": str(run["data"]), "tokenizer": str(run["tokenizer"])},
        "outputs": [str(run["checkpoint"] / "model.safetensors"), str(run["checkpoint"] / "model_card.json")],
        "metrics": {"loss": 2.75, "lr": 3e-4, "tokens_per_s": 1234.5},
        "run_id": "run-0001",
    }


@pytest.fixture(scope="session")
def release_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One release directory signed with a kept key, built once and copied by each tamper test."""
    from plyx.governance import generate_keypair, write_checkpoint_records, write_release

    root = tmp_path_factory.mktemp("release")
    keys = root / "keys"
    keys.mkdir()
    generate_keypair(keys / "release.key")
    data = root / "data.txt"
    data.write_text("some training text\n", encoding="utf-8")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(os.urandom(3000))
    write_checkpoint_records(ckpt, 5, {"inputs": {"data": str(data)}, "run_id": "r", "metrics": {"loss": 3.0}},
                             png=False)
    export = root / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(os.urandom(5000))
    write_release(export, name="toy-llm", format="onnx", source=ckpt, key=keys / "release.key", png=False,
                  metadata={"license": "Apache-2.0", "intended_use": "tests"})
    return root


@pytest.fixture
def release(release_template: Path, tmp_path: Path) -> dict[str, Path]:
    """A fresh copy of the signed release: ``dir``, ``pub`` (the signer's public key), ``key``."""
    root = tmp_path / "copy"
    shutil.copytree(release_template, root)
    return {"dir": root / "export", "pub": root / "keys" / "release.key.pub", "key": root / "keys" / "release.key"}


@pytest.fixture
def plyx(hook):
    """``plyx ...`` in-process (the specs root command), with plyx-governance as the only plugin."""
    from plyx.specs.cli import main

    return main
