from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from plyx.train import ShardError, ShardSet, write_shards
from plyx.train._shards import token_dtype


def _write(tmp: Path, vocab: int = 1000, n: int = 2500, shard_tokens: int = 1000) -> np.ndarray:
    ids = np.random.default_rng(0).integers(0, vocab, size=n)
    write_shards(tmp, {"train": [ids[:2000]], "val": [ids[2000:]]}, vocab_size=vocab, eos_id=0,
                 shard_tokens=shard_tokens)
    return ids


def test_round_trip_split_into_shards(tmp_path: Path) -> None:
    ids = _write(tmp_path)
    shards = ShardSet.open(tmp_path)
    train = shards.split("train")
    assert [info.tokens for info, _ in train] == [1000, 1000]  # 2000 tokens, 1000 per shard
    assert np.array_equal(np.concatenate([a for _, a in train]), ids[:2000])
    assert np.array_equal(shards.split("val")[0][1], ids[2000:])
    assert shards.tokens("train") == 2000 and shards.vocab_size == 1000
    assert shards.manifest["max_token_id"] == int(ids.max())
    assert shards.manifest["splits"]["train"][0]["documents"] == int((ids[:1000] == 0).sum())


@pytest.mark.parametrize(("vocab", "dtype"), [(256, "uint16"), (65536, "uint16"), (65537, "uint32"), (200_000, "uint32")])
def test_dtype_follows_vocab(tmp_path: Path, vocab: int, dtype: str) -> None:
    assert token_dtype(vocab).name == dtype
    ids = np.array([0, vocab - 1, 7], dtype=np.int64)
    write_shards(tmp_path, {"train": [ids]}, vocab_size=vocab, eos_id=None)
    shards = ShardSet.open(tmp_path)
    assert shards.manifest["dtype"] == dtype
    assert shards.split("train")[0][1].tolist() == ids.tolist()  # the largest id survives the narrow type
    assert (tmp_path / "train-00000.bin").stat().st_size == 3 * np.dtype(dtype).itemsize


def test_ids_outside_vocab_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        write_shards(tmp_path, {"train": [np.array([3, 10])]}, vocab_size=10, eos_id=None)


def test_corrupt_truncated_missing(tmp_path: Path) -> None:
    _write(tmp_path)
    shard = tmp_path / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="train-00001.bin.*sha256.*plyx data prepare"):
        ShardSet.open(tmp_path)
    ShardSet.open(tmp_path, verify=False)  # size still matches: only the digest notices
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ShardError, match="truncated or corrupt"):
        ShardSet.open(tmp_path, verify=False)
    shard.unlink()
    with pytest.raises(ShardError, match="train-00001.bin.*missing"):
        ShardSet.open(tmp_path)


def test_missing_manifest_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="does not exist"):
        ShardSet.open(tmp_path / "nowhere")
    with pytest.raises(ShardError, match="no manifest.json"):
        ShardSet.open(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other", "version": 9}))
    with pytest.raises(ShardError, match="expected 'plyx-token-shards'"):
        ShardSet.open(tmp_path)


def test_unknown_split_is_named(tmp_path: Path) -> None:
    write_shards(tmp_path, {"train": [np.arange(10)]}, vocab_size=10, eos_id=None)
    with pytest.raises(ShardError, match="no 'val' split"):
        ShardSet.open(tmp_path).split("val")
