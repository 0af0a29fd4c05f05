"""A streaming dataset of ``plyx.specs.Batch`` over memmapped shards: deterministic, resumable, rank-sharded.

Every batch is a pure function of ``(seed, split, rank, world_size, index)``,
so the data position of a run is one integer: resuming at batch ``k`` yields
exactly what an uninterrupted run would have yielded from ``k`` on, and no
reader state has to be checkpointed beyond it.

Two modes (``DataConfig.mode``):

- ``windows``: each row is a random contiguous window of ``T + 1`` tokens
  (nanoGPT's ``get_batch``). The global batch of ``B x world_size`` rows is drawn
  from one stream and rank ``r`` takes rows ``[r B, (r + 1) B)`` (DistributedSampler
  semantics), so ranks never share a row of a batch and a run at world size W with
  batch B reads exactly what one process with batch ``W B`` reads.
- ``packed``: the stream is cut into consecutive rows of ``T + 1`` tokens
  (stride ``T``), visited in a seeded order per epoch, ranks taking disjoint
  rows. Documents are separated by the EOS id; each row carries document ids
  and positions that restart at every document, and the target that would
  cross from one document into the next is masked, so attention and loss
  never cross a document boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from plyx.specs import Batch
from plyx.train._shards import ShardError, ShardSet

__all__ = ["TokenDataset", "DataStream", "IGNORE_INDEX"]

#: targets with this value carry no loss (the ``Batch`` contract's convention)
IGNORE_INDEX = -100

_SPLIT_SALT = {"train": 0, "val": 1, "test": 2}


class TokenDataset:
    """Batches of ``[batch_size, seq_len]`` token ids from one split of a ``ShardSet``.

    Args:
        shards: the opened prepared directory.
        split: ``train`` or ``val`` (any split name in the manifest).
        seq_len: tokens per row (``T``).
        batch_size: rows per batch (``B``).
        mode: ``windows`` or ``packed`` (see the module docstring).
        seed: the data seed.
        rank / world_size: this process's slice of the data in a distributed run.

    Example:
        >>> ds = TokenDataset(ShardSet.open("data/"), "train", seq_len=64, batch_size=12)
        >>> batch = ds.batch(0)          # the same Batch on every call, in every process
        >>> stream = ds.stream(start=1000)  # resume at batch 1000
    """

    def __init__(
        self,
        shards: ShardSet,
        split: str,
        *,
        seq_len: int,
        batch_size: int,
        mode: Literal["windows", "packed"] = "windows",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if mode not in ("windows", "packed"):
            raise ValueError(f"data mode {mode!r} is not one of 'windows', 'packed' (DataConfig.mode)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.shards, self.split, self.mode = shards, split, mode
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.eos_id = shards.eos_id
        self._arrays = [ids for _, ids in shards.split(split)]
        self._files = [info.file for info, _ in shards.split(split)]
        sizes = np.array([a.shape[0] for a in self._arrays], dtype=np.int64)
        T = self.seq_len
        if mode == "windows":
            # a window starting at s reads [s, s + T + 1): s < n - T
            counts = np.maximum(sizes - T, 0)
        else:
            # row k reads [k T, k T + T + 1): k < (n - 1) // T
            counts = np.maximum(sizes - 1, 0) // T
        self._offsets = np.concatenate([[0], np.cumsum(counts)])
        self.num_rows = int(self._offsets[-1])
        if self.num_rows == 0:
            raise ShardError(
                f"the {split!r} split of {str(shards.root)!r} has {int(sizes.sum())} tokens, too few for one "
                f"sequence of data.seq_len={T} (+1 for the target) in {mode} mode; lower data.seq_len or "
                f"prepare a larger corpus"
            )
        if mode == "packed" and self.num_rows < batch_size * world_size:
            raise ShardError(
                f"the {split!r} split holds {self.num_rows} packed rows of {T} tokens, fewer than one batch "
                f"({batch_size} rows x {world_size} ranks); lower batch_size or data.seq_len"
            )
        self._perm_cache: tuple[int, np.ndarray] | None = None

    # -- rows ------------------------------------------------------------------
    def _locate(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """Global row numbers -> (shard index, start token)."""
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        local = rows - self._offsets[shard]
        stride = 1 if self.mode == "windows" else self.seq_len
        return [(int(s), int(r) * stride) for s, r in zip(shard, local)]

    def _rows_for(self, index: int) -> np.ndarray:
        B = self.batch_size
        if self.mode == "windows":
            # the global batch (rank 0's seed key: a single process reads what it always read), then our slice
            rng = np.random.default_rng([self.seed, _SPLIT_SALT.get(self.split, 3), 0, index])
            rows = rng.integers(0, self.num_rows, size=B * self.world_size, dtype=np.int64)
            return rows[self.rank * B : (self.rank + 1) * B]
        # packed: the epoch's permutation, ranks interleaved batch by batch
        first = (index * self.world_size + self.rank) * B
        out = np.empty(B, dtype=np.int64)
        for j in range(B):
            epoch, within = divmod(first + j, self.num_rows)
            out[j] = self._permutation(epoch)[within]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, _SPLIT_SALT.get(self.split, 3), epoch, 7])
            self._perm_cache = (epoch, rng.permutation(self.num_rows))
        return self._perm_cache[1]

    def batch(self, index: int) -> Batch:
        """The ``index``-th batch of this rank (0-based); the same on every call."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        T = self.seq_len
        where = self._locate(self._rows_for(index))
        # (B, T + 1) int64: the memmap slices are copied here, once
        rows = np.stack([self._arrays[s][start : start + T + 1] for s, start in where]).astype(np.int64)
        x, y = rows[:, :-1], rows[:, 1:].copy()
        meta: dict[str, Any] = {
            "split": self.split,
            "index": index,
            "rank": self.rank,
            "rows": [(self._files[s], start) for s, start in where],
        }
        if self.mode == "windows":
            return Batch(input_ids=torch.from_numpy(np.ascontiguousarray(x)), targets=torch.from_numpy(y), meta=meta)
        return self._packed(x, y, meta)

    def _packed(self, x: np.ndarray, y: np.ndarray, meta: dict[str, Any]) -> Batch:
        B, T = x.shape
        if self.eos_id is None:  # no document separators: each row is one document
            doc = np.zeros((B, T), dtype=np.int64)
        else:
            eos = x == self.eos_id  # (B, T)
            # the EOS token closes its document: it belongs to the one before it
            doc = np.cumsum(eos, axis=1) - eos
            y[eos] = IGNORE_INDEX  # EOS -> first token of the next document: crosses a boundary
        # positions restart where the document id changes
        t = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
        starts = np.ones((B, T), dtype=bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        start_pos = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
        return Batch(
            input_ids=torch.from_numpy(np.ascontiguousarray(x)),
            targets=torch.from_numpy(y),
            position_ids=torch.from_numpy(t - start_pos),
            document_ids=torch.from_numpy(doc.astype(np.int64)),
            meta=meta,
        )

    def stream(self, start: int = 0) -> DataStream:
        """An endless iterator of batches from batch ``start`` on."""
        return DataStream(self, start)


class DataStream(Iterator[Batch]):
    """Endless batches of a ``TokenDataset``; ``position`` is the index of the next batch.

    ``state_dict()`` / ``load_state_dict()`` carry the position through checkpoints.
    """

    def __init__(self, dataset: TokenDataset, start: int = 0) -> None:
        self.dataset = dataset
        self.position = int(start)

    def __next__(self) -> Batch:
        batch = self.dataset.batch(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        d = self.dataset
        return {"position": self.position, "seed": d.seed, "mode": d.mode, "seq_len": d.seq_len,
                "batch_size": d.batch_size, "rank": d.rank, "world_size": d.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        d = self.dataset
        # a run resharded to another world size continues the same stream when the global batch is the same
        saved_global = state.get("batch_size", d.batch_size) * state.get("world_size", d.world_size)
        if saved_global == d.batch_size * d.world_size:
            state = {k: v for k, v in state.items() if k not in ("batch_size", "world_size")}
        for key in ("seed", "mode", "seq_len", "batch_size", "world_size"):
            if key in state and state[key] != getattr(d, key):
                raise ValueError(
                    f"the checkpoint's data stream had {key}={state[key]!r} but this run has "
                    f"{key}={getattr(d, key)!r}; resuming would not continue the same data. Resume with the "
                    f"checkpoint's config (at another world size: the same global batch, batch_size x world_size = "
                    f"{saved_global}) or start a fresh run"
                )
        self.position = int(state["position"])
