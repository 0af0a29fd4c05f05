"""``DistStrategy``: plyx-train's ``TrainStrategy`` on torch.distributed (DDP, FSDP2, HSDP, FSDP + TP).

Created by the ``plyx_train_strategy`` hook in every rank. It checks the plan
(``_plan``), initialises the process group with a timeout (a dead rank makes the
others fail, not hang), builds the ``DeviceMesh`` and answers the Trainer's calls:
model build and wrapping, gradient sync only on the last micro-batch, the
loss-parallel loss under TP, a global gradient norm over every shard, metric
reductions, and sharded checkpoints (``_checkpoint``).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plyx.specs import TrainConfig
from plyx.train import init_model
from torch import nn

from plyx.dist._comm import CommClock, CommSampler, timed_allreduce
from plyx.dist._parallelize import apply_activation_checkpointing, apply_fsdp, apply_tp, materialize
from plyx.dist._plan import Plan, plan

__all__ = ["DistStrategy", "RankFailure"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _local_at_one_rank() -> bool:
    """Whether a one-rank run steps and clips on local tensors (default); ``PLYX_DIST_LOCAL_WS1=0`` keeps the
    DTensor path, for benchmarks that measure the difference (``bench/fsdp_ws1_vs_plain.py --before``)."""
    return os.environ.get("PLYX_DIST_LOCAL_WS1", "1") != "0"


class RankFailure(RuntimeError):
    """A collective failed: most often another rank died or stalled past ``dist.timeout_s``."""


class DistStrategy:
    """One rank of a distributed run (see the module docstring and ``plyx.specs.TrainStrategy``).

    Args:
        config: the run (its ``dist`` table).
        environment: torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...).
    """

    def __init__(self, config: TrainConfig, environment: dict[str, str]) -> None:
        self.config = config
        self.rank = int(environment.get("RANK", 0))
        self.world_size = int(environment.get("WORLD_SIZE", 1))
        self.local_rank = int(environment.get("LOCAL_RANK", 0))
        local_world = int(environment.get("LOCAL_WORLD_SIZE", self.world_size))
        self.plan: Plan = plan(config, self.world_size, local_world, cuda=torch.cuda.is_available())
        self.name = self.plan.strategy
        self.is_main = self.rank == 0
        if self.plan.backend == "nccl":
            if self.local_rank >= torch.cuda.device_count():
                from plyx.specs import ConfigError

                raise ConfigError("LOCAL_RANK", f"this node has {torch.cuda.device_count()} CUDA devices",
                                  value=self.local_rank, fix="launch at most one process per GPU")
            self.device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)
        else:
            self.device = "cpu"
        self.sharded = self.name != "ddp"
        self.can_sample = self.plan.tp == 1
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(
                backend=self.plan.backend, rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=config.dist.timeout_s),
                device_id=torch.device(self.device) if self.plan.backend == "nccl" else None,
            )
            atexit.register(self.close)  # the group is released even when the run ends in an error
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cuda" if self.plan.backend == "nccl" else "cpu", self.plan.mesh_shape,
                                     mesh_dim_names=self.plan.mesh_names)
        if self.plan.tp > 1:
            self.data_rank = self.mesh["dp"].get_local_rank()
        else:
            self.data_rank = self.rank
        self.data_world_size = self.plan.dp
        # dist.async_save: DCP's background thread runs its collectives on a group of its own (gloo: a CPU
        # backend, which async_save needs even under NCCL), so they never interleave with training's on the
        # default group; every rank creates it here, in the same order
        self.checkpoint_group: Any = None
        if config.dist.async_save:
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.dist.timeout_s))
        self.pending_save: Any = None  # the asynchronous save in flight (plyx.dist._checkpoint.PendingSave)
        self.committed: list[Any] = []  # asynchronous saves committed, not yet handed to the Trainer
        self._in_loss_parallel = False
        self.module: nn.Module | None = None
        self._comm = CommClock()
        # FSDP / HSDP / FSDP + TP: no hook sees their collectives' completion, a profiled step does
        self._sampler = CommSampler(cuda=self.plan.backend == "nccl") if self.sharded and self.world_size > 1 else None
        self._step_open = False  # inside a step (between its first micro-batch and the end of its last)
        self._gradient_sync: tuple[int, bool] | None = None  # (id of the FSDP model, the flag last set on it)
        self._local_step: Any = None  # the optimizer's one-rank step on local tensors (prepare_optimizer)

    # -- model -------------------------------------------------------------------------
    def build_model(self, build: Callable[[str], nn.Module], seed: int) -> nn.Module:
        d = self.config.dist
        device = torch.device(self.device)
        ac = "full" if self.config.activation_checkpointing else d.activation_checkpointing
        if self.name == "ddp":
            module = init_model(build(self.device), seed)  # every rank builds the same values
            apply_activation_checkpointing(module, ac)
            self.module = module
            return module
        meta = d.meta_init
        module = build("meta") if meta else init_model(build(self.device), seed)
        if self.plan.tp > 1:
            apply_tp(module, self.mesh["tp"])
        apply_activation_checkpointing(module, ac)
        dp_mesh = self.mesh if self.name == "hsdp" else self.mesh[self.plan.mesh_names[0]]
        reshard, reduce_dtype = d.reshard_after_forward, _DTYPES[d.reduce_dtype]
        if dp_mesh.size() == 1:
            # one rank holds every parameter whole: resharding after the forward frees only the param_dtype
            # copies and costs a second copy-in/copy-out per block in the backward. The gradients keep
            # reduce_dtype: at one rank FSDP2 (torch 2.13, foreach_reduce) copies them into its reduce-scatter
            # buffer in reduce_dtype (chunk_cat, which casts on the way), copies that buffer into its output
            # and casts the output to the parameter's dtype when the two differ; reducing in float32 puts the
            # cast inside the chunk_cat (the same bytes moved, one kernel fewer per block than reducing in
            # bf16 and casting after), and the gradient is the same bit for bit (nothing is summed)
            reshard = False
        apply_fsdp(module, dp_mesh, param_dtype=_DTYPES[d.param_dtype], reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard, shard_head=self.plan.tp > 1)
        if meta:
            materialize(module, device, seed)
        self.module = module
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.name != "ddp":
            return module  # fully_shard changed the module in place
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.local_rank] if self.plan.backend == "nccl" else None
        ddp = DDP(module, device_ids=ids, process_group=self.mesh.get_group())
        self._comm.group = self.mesh.get_group()
        ddp.register_comm_hook(self._comm, timed_allreduce)
        return ddp

    def comm_share(self) -> float:
        """Fraction of the wall time with a collective in flight, overlap with compute included.

        DDP: every gradient all-reduce since the last call, timed by its communication hook. FSDP, HSDP
        and FSDP + TP: all-gathers, reduce-scatters and TP all-reduces of one profiled step per call (the
        first step after the previous call; see ``plyx.dist._comm.CommSampler``).
        """
        if self._sampler is not None:
            return self._sampler.share()
        return self._comm.share()

    # -- the step ----------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, model: nn.Module, *, last: bool) -> Iterator[None]:
        if self._sampler is not None and not self._step_open:
            self._sampler.step_started()  # the first micro-batch of a step: the sampled step's window opens
        self._step_open = not last
        with contextlib.ExitStack() as stack:
            if self.name == "ddp" and not last:
                stack.enter_context(model.no_sync())  # type: ignore[operator]
            elif self.name != "ddp" and self._gradient_sync != (id(model), last):
                # FSDP2 keeps the flag until it is set again, and setting it walks every module of the model
                # (0.5-0.7 ms for the 22 blocks of a 1B Llama on a slow host core): only when it changes, which
                # without accumulation is never after the first step
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
                self._gradient_sync = (id(model), last)
            if self.plan.tp > 1:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())  # the backward of the vocab-parallel loss too
                self._in_loss_parallel = True
                stack.callback(setattr, self, "_in_loss_parallel", False)
            yield

    def loss(self, model: nn.Module, batch: Any, *, label_smoothing: float = 0.0, z_loss: float = 0.0) -> Any:
        """Under TP: cross-entropy over vocab-sharded logits (``loss_parallel``); otherwise the Trainer's."""
        if self.plan.tp == 1:
            return None
        if z_loss:
            raise ValueError("z_loss is not available with tensor parallelism (the vocab-parallel loss has no "
                             "log-sum-exp term); set z_loss = 0 or use strategy = 'fsdp'")
        hidden = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids,
                       attention_mask=batch.attention_mask, return_hidden=True)  # (B, T, D), replicated over tp
        logits = model.lm_head(hidden)  # (B, T, V) DTensor, Shard(-1) over tp: the vocab split
        flat = logits.flatten(0, 1).float()  # (B T, V)
        with contextlib.nullcontext() if self._in_loss_parallel else _loss_parallel():
            loss = F.cross_entropy(flat, batch.targets.reshape(-1).to(flat.device), ignore_index=-100,
                                   label_smoothing=label_smoothing)
        return loss.full_tensor()  # a replicated 0-dim DTensor -> a plain tensor (differentiable)

    def clip_grad_norm(self, parameters: Sequence[torch.Tensor], max_norm: float) -> float:
        """The L2 norm of all gradients (every shard, every mesh), then ``clip_grad_norm_``'s scaling.

        Parameters of one run can live on different meshes (FSDP+TP: 2-D weights, 1-D norms);
        ``torch.nn.utils.get_total_norm`` reduces each group and the groups' squares add up.
        """
        from torch.distributed.tensor import DTensor

        if self.world_size == 1 and _local_at_one_rank():  # every gradient whole on the rank: no DTensor dispatch
            return float(self.clip_grad_norm_on_device(parameters, max_norm))
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in parameters:
            if p.grad is not None:
                g = p.grad
                key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
                groups.setdefault(key, []).append(g)
        total_sq = 0.0
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()  # sums the shards' squares across the mesh
            total_sq += float(norm.double()) ** 2
        total = math.sqrt(total_sq)
        if math.isfinite(total) and max_norm < math.inf:
            coef = min(max_norm / (total + 1e-6), 1.0)  # clip_grad_norm_'s clamped coefficient
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
        return total

    def clip_grad_norm_on_device(self, parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The Trainer's one-rank step (no host sync): the norm as a 0-dim tensor, gradients clipped in place.

        At world size 1 every mesh has one rank and each DTensor gradient's local tensor is the whole
        gradient: the norm and the scaling run on those (``plyx.dist._local``), the arithmetic of
        ``clip_grad_norm_`` without DTensor's dispatch per foreach call nor the norm's ``full_tensor``.
        On several ranks it is ``clip_grad_norm`` (which reads the norm on the host).
        """
        if self.world_size > 1:
            return torch.tensor(self.clip_grad_norm(parameters, max_norm))
        if not _local_at_one_rank():  # the DTensor path (plyx-train's own on-device clip)
            norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], 2.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
            return norm
        from plyx.dist._local import clip_local_, whole_local

        return clip_local_([whole_local(p.grad) for p in parameters if p.grad is not None], max_norm)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by the Trainer once its optimizer exists: at world size 1 (FSDP2, HSDP or FSDP + TP on one
        rank) the optimizer steps on its parameters' local tensors, which are the whole tensors there
        (``plyx.dist._local.LocalShardStep``); the state stays DTensors for checkpoints. On several ranks the
        local tensors are shards and the optimizer keeps DTensor's path, which a non-elementwise optimizer
        (Adafactor's row and column statistics) needs."""
        if self.sharded and self.world_size == 1 and _local_at_one_rank():
            from plyx.dist._local import LocalShardStep

            self._local_step = LocalShardStep(optimizer)

    # -- metrics -----------------------------------------------------------------------
    def _collective(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise RankFailure(
                f"rank {self.rank}: {what} failed ({str(exc).splitlines()[0][:200]}); another rank probably "
                f"died or stalled past dist.timeout_s={self.config.dist.timeout_s}s (the launcher's summary names "
                f"it)"
            ) from None

    def reduce_mean(self, values: Sequence[float]) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]  # the mean over one rank: no collective, no device round trip
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._collective(lambda: dist.all_reduce(t), "all-reduce of the step metrics")
        # ranks of one TP group hold the same values: the mean over the world is the mean over dp
        return (t / self.world_size).tolist()

    def gather(self, value: float) -> list[float]:
        if self.world_size == 1:
            return [float(value)]
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._collective(lambda: dist.all_gather(out, t), "all-gather of the rank metrics")
        return [float(o) for o in out]

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        self._collective(lambda: dist.barrier(), "barrier")

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, manager: Any, step: int, module: nn.Module, optimizer: Any, scheduler: Any, *,
                        state: dict[str, Any], card_fields: dict[str, Any], tokenizer_file: Any) -> Any:
        from plyx.dist._checkpoint import save_sharded

        return save_sharded(self, manager, step, module, optimizer, scheduler, state=state,
                            card_fields=card_fields, tokenizer_file=tokenizer_file)

    def load_checkpoint(self, path: Any, module: nn.Module, optimizer: Any) -> tuple[Any, Any] | None:
        from plyx.dist._checkpoint import load_into

        return load_into(self, path, module, optimizer)

    def committed_checkpoints(self, *, wait: bool = False) -> list[Any]:
        """Checkpoints whose asynchronous save completed and was committed since the last call (rank 0
        commits; every rank gets the paths). ``wait``: block for the save in flight (the end of a run).
        Synchronous saves are committed inside ``save_checkpoint`` and never listed here."""
        from plyx.dist._checkpoint import finish_pending

        finish_pending(self, wait=wait)
        done, self.committed = self.committed, []
        return done

    @property
    def async_checkpoints(self) -> bool:
        """Whether ``save_checkpoint`` returns before its checkpoint is committed (``dist.async_save``)."""
        return self.checkpoint_group is not None

    def close(self) -> None:
        if self.pending_save is not None:  # at exit, an asynchronous save in flight is completed or dropped
            import sys

            try:
                self.committed_checkpoints(wait=True)
            except RankFailure as exc:
                print(f"plyx-dist: {exc}", file=sys.stderr)
        if self._owns_group and dist.is_initialized():
            try:  # leave together: a rank tearing down its gloo pairs while a peer still talks aborts the peer
                dist.barrier()
            except (RuntimeError, dist.DistBackendError):
                pass  # a peer is already gone (the launcher reports it)
            dist.destroy_process_group()
            self._owns_group = False


@contextlib.contextmanager
def _loss_parallel() -> Iterator[None]:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
