"""``TrainStrategy``: what a distributed-training plugin gives plyx-train's Trainer (no torch here).

plyx-train asks the ``plyx_train_strategy`` hook for one when the run is
distributed (``WORLD_SIZE`` is set, as ``torchrun`` and ``plyx train --nproc N``
do); plyx-dist answers with DDP, FSDP2, HSDP or FSDP + tensor parallelism. The
Trainer keeps its loop and calls the strategy at these seams only::

    module = strategy.build_model(build, seed)   # meta init / sharding / TP plans, then the values
    model = strategy.wrap(module)                # DDP wrapper (or the module itself)
    for each micro-batch:
        with strategy.micro_batch(model, last=...):   # no_sync / set_requires_gradient_sync, loss parallel
            loss = strategy.loss(model, batch) or the Trainer's own loss
            loss.backward()
    grad_norm = strategy.clip_grad_norm(params, max_norm)
    metrics = strategy.reduce_mean([...])        # the same numbers on every rank
    strategy.save_checkpoint(...) / strategy.load_checkpoint(...)   # collective, sharded

Types are ``Any`` so that plyx-specs stays free of torch; the documented types are torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["TrainStrategy"]


@runtime_checkable
class TrainStrategy(Protocol):
    """One process's view of a distributed training run.

    Attributes:
        name: ``ddp``, ``fsdp``, ``hsdp`` or ``fsdp+tp`` (``DistConfig.strategy``).
        rank / world_size: this process in the whole run.
        data_rank / data_world_size: its slice of the data (the data-parallel coordinates:
            ranks of one tensor-parallel group read the same batches).
        is_main: whether this process prints and writes the run's files (global rank 0).
        device: the torch device string of this rank (``cuda:LOCAL_RANK`` or ``cpu``).
        sharded: whether parameters are sharded (DTensors): per-parameter probes are skipped then.
        can_sample: whether ``generate`` on the module gives text (False under tensor parallelism).
    """

    name: str
    rank: int
    world_size: int
    data_rank: int
    data_world_size: int
    is_main: bool
    device: str
    sharded: bool
    can_sample: bool

    def build_model(self, build: Callable[[str], Any], seed: int) -> Any:
        """Build, parallelise and initialise the model of this rank.

        :param build: ``build(device) -> nn.Module`` makes the single-device model on ``device``
            (``"meta"`` allocates nothing); its ``reset_parameters()`` gives the initial values.
        :param seed: initial values equal those of ``torch.manual_seed(seed); reset_parameters()``
            on one device, whatever the sharding.
        :return: the module whose parameters the optimizer updates.
        """

    def wrap(self, module: Any) -> Any:
        """The module the forward runs through (a DDP wrapper, or ``module`` itself)."""

    def micro_batch(self, model: Any, *, last: bool) -> AbstractContextManager[Any]:
        """A context around one micro-batch's forward and backward.

        :param last: the last micro-batch of the optimizer step: gradients are synchronised
            after its backward only (gradient accumulation without communication).
        """

    def loss(self, model: Any, batch: Any, *, label_smoothing: float = 0.0, z_loss: float = 0.0) -> Any | None:
        """The micro-batch loss when the strategy computes it itself (loss parallel); None: the Trainer's."""

    def clip_grad_norm(self, parameters: Sequence[Any], max_norm: float) -> float:
        """Clip the global gradient norm (over every shard) to ``max_norm``; return the norm before clipping."""

    def reduce_mean(self, values: Sequence[float]) -> list[float]:
        """The mean of each value over the data-parallel ranks (every rank gets the same list)."""

    def gather(self, value: float) -> list[float]:
        """``value`` of every rank, indexed by rank (every rank gets the list)."""

    def save_checkpoint(self, manager: Any, step: int, module: Any, optimizer: Any, scheduler: Any, *,
                        state: dict[str, Any], card_fields: dict[str, Any], tokenizer_file: Any) -> Any:
        """Write the checkpoint of ``step`` atomically (every rank calls it); returns its directory.

        :param manager: the run's ``plyx.train.CheckpointManager`` (directory layout, rotation).
        :param state: the JSON-able trainer state (data position, config, metrics...).
        """

    def load_checkpoint(self, path: Any, module: Any, optimizer: Any) -> tuple[Any, Any] | None:
        """Load model and optimizer state from ``path`` (sharded or plain, any world size).

        :return: this rank's RNG state ``(json_part, tensors)`` when the checkpoint holds one.
        """

    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Release the process group if this strategy created it."""
