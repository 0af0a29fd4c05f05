"""plyx checkpoints: round trip, card v2 (and the v1 migration), atomic writes, integrity and mismatch errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from plyx.model import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    TransformerLM,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
)
from plyx.specs import ModelCard
from plyx.specs.config import migrations_for


@pytest.fixture
def saved(tmp_path: Path, tiny, random_model) -> tuple[TransformerLM, Path]:
    model = random_model(tiny(arch="qwen2", qkv_bias=True))
    path = save_checkpoint(model, tmp_path / "ckpt", card_fields={"name": "tiny-qwen2", "training": {"steps": 3}},
                           max_shard_bytes=20_000)
    return model, path


def test_round_trip_and_card(saved) -> None:
    model, path = saved
    card = open_checkpoint(path).card
    assert card.version == ModelCard.VERSION == 2
    assert card.name == "tiny-qwen2" and card.training == {"steps": 3} and card.layout == "plyx"
    assert card.model == model.config and card.num_params == model.num_params()
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(card.shards) == shards == sorted(card.shard_bytes)
    assert all(card.shard_bytes[s] == (path / s).stat().st_size for s in shards)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) == set(card.tensors)
    loaded = load_checkpoint(path)
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_load_in_another_dtype(saved) -> None:
    model, path = saved
    half = load_checkpoint(path, dtype="bfloat16")
    assert half.embed_tokens.weight.dtype == torch.bfloat16 and half.config.dtype == "bfloat16"
    torch.testing.assert_close(half.embed_tokens.weight.float(), model.embed_tokens.weight.bfloat16().float())


def test_write_is_atomic_and_replaces(saved, tiny, random_model) -> None:
    _, path = saved
    other = random_model(tiny(arch="qwen2", qkv_bias=True))
    save_checkpoint(other, path)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temporary directories left behind"
    ids = torch.randint(0, 97, (1, 5))
    torch.testing.assert_close(load_checkpoint(path)(ids), other(ids))

    class Boom(RuntimeError):
        pass

    def explode(*args, **kwargs):
        raise Boom

    import plyx.model._checkpoint as mod

    original = mod.save_file
    mod.save_file = explode
    try:
        with pytest.raises(Boom):
            save_checkpoint(random_model(tiny()), path)
    finally:
        mod.save_file = original
    torch.testing.assert_close(load_checkpoint(path)(ids), other(ids))  # the old one is intact
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_tampered_shard_is_named(saved) -> None:
    _, path = saved
    shard = sorted(path.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # flip bits in the tensor data: same size, other digest
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=f"'{shard.name}' has sha256 .* the card says") as info:
        load_checkpoint(path)
    assert info.value.shard == shard.name
    load_checkpoint(path, verify=False)  # opting out reads it anyway


def test_truncated_shard_names_both_sizes(saved) -> None:
    _, path = saved
    shard = sorted(path.glob("*.safetensors"))[0]
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointIntegrityError, match=f"'{shard.name}' is truncated: {full - 100} bytes on disk, "
                                                       f"the card says {full}"):
        load_checkpoint(path)
    # without the card's sizes, the safetensors header still gives it away
    with pytest.raises(CheckpointIntegrityError, match="is truncated.*header describes"):
        load_checkpoint(path, verify=False)


def test_config_mismatch_names_every_tensor(saved, tiny) -> None:
    _, path = saved
    wrong = tiny(arch="qwen2", qkv_bias=True, d_ff=64, vocab_size=100, n_layers=1)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, config=wrong)
    text = str(info.value)
    assert "'embed_tokens.weight': checkpoint shape [97, 32] vs model shape [100, 32]" in text
    assert "'layers.0.mlp.up_proj.weight': checkpoint shape [48, 32] vs model shape [64, 32]" in text
    assert "unexpected tensor 'layers.1.self_attn.q_proj.weight'" in text
    with pytest.raises(CheckpointMismatchError, match="missing tensor 'layers.0.self_attn.q_norm.weight'"):
        load_checkpoint(path, config=tiny(arch="qwen3", qkv_bias=True, qk_norm=True))


def test_v1_card_is_migrated(saved) -> None:
    model, path = saved
    assert 1 in migrations_for("model_card")
    doc = json.loads((path / "model_card.json").read_text())
    doc["version"] = 1
    del doc["shard_bytes"], doc["num_params"]  # fields v1 did not have
    doc["model"]["version"] = 1  # and a v1 model config inside (nanoGPT names)
    m = doc["model"]
    m["n_embd"], m["n_layer"], m["n_head"] = m.pop("d_model"), m.pop("n_layers"), m.pop("n_heads")
    (path / "model_card.json").write_text(json.dumps(doc))
    ckpt = open_checkpoint(path)
    assert ckpt.card.version == 2 and ckpt.card.shard_bytes == {}
    assert ckpt.card.num_params == model.num_params()  # computed by the migration from the tensor shapes
    assert ckpt.card.model == model.config
    ids = torch.randint(0, 97, (1, 5))
    torch.testing.assert_close(load_checkpoint(ckpt)(ids), model(ids))  # digests still checked


def test_newer_card_is_refused(saved) -> None:
    _, path = saved
    doc = json.loads((path / "model_card.json").read_text())
    doc["version"] = 3
    (path / "model_card.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="newer than this plyx-specs.*upgrade plyx-specs"):
        open_checkpoint(path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither model_card.json"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(tmp_path / "nope")


def test_no_pickle_anywhere(saved, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model, path = saved
    load_checkpoint(path)
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in path.iterdir())
