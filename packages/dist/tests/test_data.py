"""Per-rank data: disjoint slices whose union is what one process reads at the same global batch."""

from __future__ import annotations

import pytest
import torch
from plyx.train import ShardSet, TokenDataset


@pytest.mark.parametrize("mode", ["windows", "packed"])
def test_rank_slices_tile_the_single_process_batch(prepared, mode):
    shards = ShardSet.open(prepared)
    one = TokenDataset(shards, "train", seq_len=16, batch_size=6, mode=mode, seed=3)
    ranks = [TokenDataset(shards, "train", seq_len=16, batch_size=2, mode=mode, seed=3, rank=r, world_size=3)
             for r in range(3)]
    for index in (0, 1, 7, 40):
        whole = one.batch(index)
        parts = [ds.batch(index) for ds in ranks]
        assert torch.equal(torch.cat([p.input_ids for p in parts]), whole.input_ids)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
        rows = [row for p in parts for row in p.meta["rows"]]
        if mode == "packed":  # packed rows are visited once per epoch: no two ranks share one
            assert len(set(rows)) == len(rows)
        assert [p.meta["rank"] for p in parts] == [0, 1, 2]


def test_a_stream_resumes_at_another_world_size_with_the_same_global_batch(prepared):
    shards = ShardSet.open(prepared)
    two = TokenDataset(shards, "train", seq_len=16, batch_size=2, seed=3, rank=1, world_size=2).stream(5)
    four = TokenDataset(shards, "train", seq_len=16, batch_size=1, seed=3, rank=2, world_size=4).stream()
    four.load_state_dict(two.state_dict())
    assert four.position == 5
    other = TokenDataset(shards, "train", seq_len=16, batch_size=2, seed=3, rank=0, world_size=4).stream()
    with pytest.raises(ValueError, match="batch_size x world_size = 4"):
        other.load_state_dict(two.state_dict())  # global batch 8 vs 4: another data stream
