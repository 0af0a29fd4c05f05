from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from plyx.train import ShardError, ShardSet, TokenDataset, write_shards
from plyx.train._dataset import IGNORE_INDEX

EOS = 0


def _docs_stream(seed: int = 0, docs: int = 60) -> np.ndarray:
    """Documents of random length (ids 1..49), each followed by EOS."""
    rng = np.random.default_rng(seed)
    parts = [np.append(rng.integers(1, 50, size=rng.integers(3, 30)), EOS) for _ in range(docs)]
    return np.concatenate(parts)


@pytest.fixture()
def shards(tmp_path: Path) -> ShardSet:
    stream = _docs_stream()
    # two train shards so rows come from both files
    write_shards(tmp_path, {"train": [stream[:700], stream[700:]], "val": [stream[:100]]}, vocab_size=50,
                 eos_id=EOS, shard_tokens=600)
    return ShardSet.open(tmp_path)


def test_windows_are_contiguous_and_targets_shifted(shards: ShardSet) -> None:
    ds = TokenDataset(shards, "train", seq_len=12, batch_size=5, seed=3)
    batch = ds.batch(4)
    assert batch.validate() == {"B": 5, "T": 12}
    arrays = {info.file: arr for info, arr in shards.split("train")}
    for row, (file, start) in enumerate(batch.meta["rows"]):
        window = np.asarray(arrays[file][start : start + 13], dtype=np.int64)
        assert batch.input_ids[row].tolist() == window[:-1].tolist()
        assert batch.targets[row].tolist() == window[1:].tolist()
    assert batch.position_ids is None and batch.document_ids is None


def test_deterministic_under_seed_and_resumable(shards: ShardSet) -> None:
    a = TokenDataset(shards, "train", seq_len=8, batch_size=4, seed=1)
    b = TokenDataset(shards, "train", seq_len=8, batch_size=4, seed=1)
    other = TokenDataset(shards, "train", seq_len=8, batch_size=4, seed=2)
    assert torch.equal(a.batch(7).input_ids, b.batch(7).input_ids)
    assert not torch.equal(a.batch(7).input_ids, other.batch(7).input_ids)
    straight = a.stream()
    first = [next(straight) for _ in range(6)]
    resumed = b.stream()
    resumed.load_state_dict(a.stream(3).state_dict())  # a checkpoint taken after 3 batches
    assert resumed.position == 3
    for expected in first[3:]:
        assert torch.equal(next(resumed).input_ids, expected.input_ids)


def test_resume_with_other_settings_is_refused(shards: ShardSet) -> None:
    state = TokenDataset(shards, "train", seq_len=8, batch_size=4, seed=1).stream(5).state_dict()
    with pytest.raises(ValueError, match="batch_size=4.*batch_size=2"):
        TokenDataset(shards, "train", seq_len=8, batch_size=2, seed=1).stream().load_state_dict(state)


def _reference_packed(row: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Document ids, positions and targets of a T+1 row, written the slow obvious way."""
    x, y = row[:-1], row[1:]
    docs, pos, tgt = [], [], []
    doc = p = 0
    for t, tok in enumerate(x):
        docs.append(doc)
        pos.append(p)
        tgt.append(IGNORE_INDEX if tok == EOS else y[t])
        p += 1
        if tok == EOS:  # the next token starts a new document
            doc, p = doc + 1, 0
    return docs, pos, tgt


def test_packed_rows_carry_documents(shards: ShardSet) -> None:
    ds = TokenDataset(shards, "train", seq_len=16, batch_size=6, mode="packed", seed=0)
    arrays = {info.file: arr for info, arr in shards.split("train")}
    seen_boundary = False
    for index in range(4):
        batch = ds.batch(index)
        batch.validate()
        for r, (file, start) in enumerate(batch.meta["rows"]):
            assert start % 16 == 0  # packed rows are consecutive, stride T
            row = [int(v) for v in arrays[file][start : start + 17]]
            docs, pos, tgt = _reference_packed(row)
            assert batch.input_ids[r].tolist() == row[:-1]
            assert batch.document_ids[r].tolist() == docs
            assert batch.position_ids[r].tolist() == pos
            assert batch.targets[r].tolist() == tgt
            seen_boundary |= max(docs) > 0
    assert seen_boundary


def test_packed_epoch_visits_every_row_once_and_ranks_are_disjoint(shards: ShardSet) -> None:
    world = 2
    ranks = [TokenDataset(shards, "train", seq_len=16, batch_size=3, mode="packed", seed=5, rank=r, world_size=world)
             for r in range(world)]
    rows_per_epoch = ranks[0].num_rows
    seen: list[tuple[str, int]] = []
    index = 0
    while len(seen) + 3 * world <= rows_per_epoch:
        for ds in ranks:
            seen += ds.batch(index).meta["rows"]
        index += 1
    assert len(seen) == len(set(seen))  # no row twice within an epoch, across ranks
    whole = TokenDataset(shards, "train", seq_len=16, batch_size=rows_per_epoch, mode="packed", seed=5)
    assert len(set(whole.batch(0).meta["rows"])) == rows_per_epoch


def test_too_little_data_is_a_clear_error(tmp_path: Path) -> None:
    write_shards(tmp_path, {"train": [np.arange(20) % 7]}, vocab_size=7, eos_id=None)
    shards = ShardSet.open(tmp_path)
    with pytest.raises(ShardError, match="too few for one sequence of data.seq_len=64"):
        TokenDataset(shards, "train", seq_len=64, batch_size=2)
    with pytest.raises(ShardError, match="fewer than one batch"):
        TokenDataset(shards, "train", seq_len=4, batch_size=8, mode="packed")
    with pytest.raises(ValueError, match="rank 2 is outside"):
        TokenDataset(shards, "train", seq_len=4, batch_size=1, rank=2, world_size=2)
