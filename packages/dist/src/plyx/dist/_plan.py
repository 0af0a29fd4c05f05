"""What a run's ``[dist]`` table means at a world size, checked before any process group or model exists.

``plan(config, world_size, local_world_size)`` turns ``DistConfig`` into a ``Plan``
(mesh shape and names, data-parallel degree, backend) or raises ``ConfigError``
naming the field, the value and the fix: a strategy that the model or the world
cannot honour fails here, in every rank, before any work.
"""

from __future__ import annotations

import attrs
from plyx.specs import ConfigError, TrainConfig

__all__ = ["Plan", "plan"]


@attrs.frozen
class Plan:
    """The device-mesh layout of a run.

    Attributes:
        strategy: ``ddp``, ``fsdp``, ``hsdp`` or ``fsdp+tp``.
        mesh_shape / mesh_names: the ``DeviceMesh`` (outer dimension first).
        dp: data-parallel ranks (ranks that read different batches).
        tp: tensor-parallel degree (1 without TP).
        backend: ``nccl`` or ``gloo``.
    """

    strategy: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    dp: int
    tp: int
    backend: str


def _backend(config: TrainConfig, cuda: bool) -> str:
    d = config.dist
    if d.backend != "auto":
        if d.backend == "nccl" and not cuda:
            raise ConfigError("$.dist.backend", "nccl needs CUDA devices, and none is usable here",
                              value=d.backend, fix="use backend = 'gloo' (or 'auto') on CPU")
        return d.backend
    if config.device == "cpu" or not cuda:
        return "gloo"
    return "nccl"


def plan(config: TrainConfig, world_size: int, local_world_size: int, *, cuda: bool) -> Plan:
    """Check ``config.dist`` against the model and the world; the mesh to build.

    Args:
        config: the run.
        world_size: processes in the run (``WORLD_SIZE``).
        local_world_size: processes on this node (``LOCAL_WORLD_SIZE``), for hsdp's default.
        cuda: whether CUDA devices are usable.

    Returns:
        the ``Plan``.

    Raises:
        ConfigError: the strategy cannot be honoured (the message names field, value and fix).
    """
    d, m = config.dist, config.model
    backend = _backend(config, cuda)
    if world_size < 1:
        raise ConfigError("WORLD_SIZE", "must be at least 1", value=world_size)
    if d.activation_checkpointing != "none" and config.activation_checkpointing:
        raise ConfigError("$.dist.activation_checkpointing",
                          "activation checkpointing is asked twice (activation_checkpointing = true as well)",
                          value=d.activation_checkpointing,
                          fix="set one of them: the top-level flag means dist.activation_checkpointing = 'full'")
    if d.strategy == "ddp":
        return Plan("ddp", (world_size,), ("dp",), world_size, 1, backend)
    if d.strategy == "fsdp":
        if d.dp_shard not in (0, world_size):
            raise ConfigError("$.dist.dp_shard", f"fsdp shards over all {world_size} ranks",
                              value=d.dp_shard, fix=f"leave dp_shard at 0 (or {world_size}), or use strategy = 'hsdp'")
        return Plan("fsdp", (world_size,), ("dp_shard",), world_size, 1, backend)
    if d.strategy == "hsdp":
        shard = d.dp_shard or local_world_size
        if shard < 1 or world_size % shard:
            raise ConfigError("$.dist.dp_shard", f"the shard group size must divide the world size {world_size}",
                              value=shard, fix=f"choose dp_shard from the divisors of {world_size}")
        replicate = d.dp_replicate or world_size // shard
        if replicate * shard != world_size:
            raise ConfigError("$.dist.dp_replicate",
                              f"dp_replicate x dp_shard = {replicate} x {shard} is not the world size {world_size}",
                              value=replicate, fix=f"set dp_replicate = {world_size // shard} or leave it at 0")
        return Plan("hsdp", (replicate, shard), ("dp_replicate", "dp_shard"), world_size, 1, backend)
    # fsdp+tp
    tp = d.tp_size
    if world_size % tp:
        raise ConfigError("$.dist.tp_size", f"tensor-parallel degree {tp} does not divide the world size {world_size}",
                          value=tp, fix=f"choose tp_size from the divisors of {world_size}, or launch a multiple of "
                                        f"{tp} processes")
    for field, value in (("n_heads", m.n_heads), ("kv_heads", m.kv_heads), ("d_ff", m.d_ff),
                         ("vocab_size", m.vocab_size)):
        if value % tp:
            name = "n_kv_heads" if field == "kv_heads" else field
            raise ConfigError("$.dist.tp_size",
                              f"tensor parallelism splits model.{name} = {value} over {tp} ranks, and {tp} does not "
                              f"divide it", value=tp, fix=f"choose a tp_size that divides model.{name}")
    if getattr(m, "moe", None) is not None:
        raise ConfigError("$.dist.strategy", "the tensor-parallel plan covers dense SwiGLU blocks; this model's blocks "
                          "are mixtures of experts (model.moe)", value=d.strategy,
                          fix="use strategy = 'fsdp' (or 'hsdp', 'ddp') for MoE models")
    if m.tie_embeddings:
        raise ConfigError("$.dist.tp_size",
                          "tensor parallelism shards the LM head over the vocabulary (loss parallel), which a head "
                          "tied to the input embedding cannot be", value=tp,
                          fix="set model.tie_embeddings = false, or use strategy = 'fsdp'")
    if d.dp_shard not in (0, world_size // tp):
        raise ConfigError("$.dist.dp_shard", f"fsdp+tp shards over the {world_size // tp} data-parallel ranks",
                          value=d.dp_shard, fix="leave dp_shard at 0")
    dp = world_size // tp
    return Plan("fsdp+tp", (dp, tp), ("dp", "tp"), dp, tp, backend)
