"""The ``Trainer``: one ``TrainConfig`` in, a trained and checkpointed model out.

Everything that can be wrong with the inputs (data, tokenizer, vocabulary,
memory, the checkpoint to resume) is checked in ``Trainer.__init__``, before
any step runs. ``fit()`` then loops::

    for each optimizer step:
        for each of grad_accum micro-batches:          # bf16 autocast when asked
            loss = linear_cross_entropy(model(x, return_hidden=True), lm_head, y)
            (loss / grad_accum).backward()
        stop if the loss or the gradient norm is not finite (step and batch named)
        clip, optimizer.step(), scheduler.step()
        metrics -> CSV/TensorBoard/progress bar; plyx_on_train_step_end
        evaluate / checkpoint every N steps; checkpoint and stop on SIGINT/SIGTERM

Exactness of resume: the data position is one integer (batches are a pure
function of it), optimizer/scheduler/RNG states are saved bit for bit, and
sampling uses its own generator, so N steps + kill + resume N steps equals
2N steps exactly on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from plyx.specs import ConfigError, PlyxError, TrainConfig, get_plugin_manager
from plyx.train._card import card_fields, tokenizer_config
from plyx.train._checkpoint import CheckpointManager, ResumeError, optimizer_from_flat, restore_rng
from plyx.train._cpu_alloc import tune_cpu_allocator
from plyx.train._dataset import TokenDataset
from plyx.train._datasource import resolve_data_dir
from plyx.train._distributed import LocalStrategy, resolve_strategy
from plyx.train._generate import generate_ids
from plyx.train._loss import lm_loss
from plyx.train._memory import _size, plan_memory, propose_fit
from plyx.train._metrics import (
    SPECTRAL_RANGE,
    MetricsWriter,
    grad_norms_by_group,
    layer_groups,
    peak_flops,
    peak_memory_mb,
    spectral_ratios,
)
from plyx.train._optim import build_optimizer
from plyx.train._progress import StepTimer, format_log_line, format_speed, progress_bar, use_bar
from plyx.train._recovery import Recovery, mark_hooked, recover, rerun_saved_hooks
from plyx.train._schedule import build_scheduler
from plyx.train._shards import MANIFEST, ShardSet
from plyx.train._step_stats import PendingStep, StepStats, can_skip_update, skip_update
from plyx.train._tokenizer import CHAR, Tokenizer, load_tokenizer
from plyx.train._transfer import no_sync, to_device
from torch import nn

__all__ = ["Trainer", "TrainOptions", "TrainResult", "NonFiniteLossError", "resolve_device", "estimate_memory"]


class NonFiniteLossError(PlyxError, FloatingPointError):
    """The loss or gradient norm became NaN/inf; the run stopped before applying that step.

    Attributes:
        step: the optimizer step (1-based) that failed.
        what: ``loss`` or ``grad_norm``.
        batch: the offending batch's provenance (split, index, shard rows).
        checkpoint: the last good checkpoint, left intact (None if none was written yet).
    """

    def __init__(self, step: int, what: str, value: float, batch: dict[str, Any], checkpoint: Path | None) -> None:
        self.step, self.what, self.value, self.batch, self.checkpoint = step, what, value, batch, checkpoint
        rows = batch.get("rows", [])
        where = f"batch {batch.get('index')} of split {batch.get('split')!r}" + (f" (rows {rows[:4]}...)" if rows else "")
        last = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint had been written yet"
        super().__init__(
            f"{what} is {value} at step {step}, {where}; the run stopped before this update and {last}. "
            f"Lower optimizer.lr, raise schedule.warmup_steps or keep optimizer.grad_clip > 0, then resume from it"
        )


@attrs.define(kw_only=True)
class TrainOptions:
    """Run options that are not part of ``TrainConfig`` (how to run, not what to train).

    Attributes:
        resume: a checkpoint or run directory to continue from, ``"auto"`` (the out_dir's latest
            if any), or None (a fresh run; refuses an out_dir that already has checkpoints).
        overwrite: allow a fresh run in an out_dir that has checkpoints (they are replaced).
        keep_checkpoints: how many of the newest checkpoints to keep.
        progress: show a rich progress bar on a terminal (elsewhere, and when False, ``print_fn`` gets a
            line every ``log_every`` steps).
        tensorboard: also write TensorBoard event files (needs the ``tensorboard`` package).
        peak_flops: the device's peak FLOP/s for MFU (default: known GPUs, ``$PLYX_PEAK_FLOPS``).
        spectral_probe_every: steps between MLP/attention spectral-norm ratio probes (0: off).
        label_smoothing / z_loss: loss options passed to ``linear_cross_entropy``.
        sample_prompt: text the evaluation samples start from ("" starts a fresh document).
        sample_temperature / sample_top_k: sampling of the evaluation samples.
        rank / world_size: this process's data shard; only rank 0 writes files.
        wrap_model: applied to the model after setup (plyx-dist passes DDP/FSDP here).
        handle_signals: checkpoint and stop cleanly on SIGINT/SIGTERM.
        verify_data: recompute the shards' sha256 before training.
        memory_bytes: memory to check the estimate against (default: the device's total).
        async_stats: read each step's loss and grad norm back a step late, without a host sync inside
            the step (a non-finite step's update is skipped on the device, then reported); None: on CUDA
            with a fused optimizer. Metrics, hooks and log lines are the same either way.
        sync_debug: on CUDA with ``async_stats``, make any host sync inside a step (the batch's transfer
            through the optimizer's update; logging steps' per-layer norms excepted) raise
            (``torch.cuda.set_sync_debug_mode("error")``): finds what stalls the device (tests, benchmarks).
        data_cache: where the bundled corpus is prepared (default: ``$PLYX_DATA_DIR``, else
            ``$PLYX_CACHE_DIR/data``, else ~/.cache/plyx/data).
        print_fn: where progress lines go when the bar is off (None: silent).
        name / license / description: the model card's fields; they override the config's ``[card]``
            table (``TrainConfig.card``), whose empty fields default to the run directory's name,
            ``NOASSERTION`` and a summary of model, data, steps and losses.
    """

    resume: str | None = None
    overwrite: bool = False
    keep_checkpoints: int = 3
    progress: bool = True
    tensorboard: bool = True
    peak_flops: float | None = None
    spectral_probe_every: int = 0
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    sample_prompt: str = ""
    sample_temperature: float = 0.8
    sample_top_k: int | None = 50
    rank: int = 0
    world_size: int = 1
    wrap_model: Callable[[nn.Module], nn.Module] | None = None
    handle_signals: bool = True
    verify_data: bool = True
    memory_bytes: int | None = None
    async_stats: bool | None = None
    sync_debug: bool = False
    data_cache: str | None = None
    print_fn: Callable[[str], None] | None = None
    name: str | None = None
    license: str | None = None
    description: str | None = None


@attrs.frozen
class TrainResult:
    """What ``fit()`` did.

    Attributes:
        step: the last completed step.
        losses: training loss of each step run by this call, in order.
        metrics: the last metrics (loss, val_loss, val_ppl...).
        checkpoint: the last checkpoint written (None when nothing was saved).
        sample: the last generated sample ("" when disabled).
        stopped: ``SIGINT``/``SIGTERM`` when interrupted, None when the run completed.
        out_dir: the run directory.
    """

    step: int
    losses: list[float]
    metrics: dict[str, float]
    checkpoint: Path | None
    sample: str
    stopped: str | None
    out_dir: Path


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else is checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError("$.device", "not a torch device", value=name, fix="use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("$.device", "CUDA is not available on this machine", value=name, fix="use device=cpu or auto")
    return device


def estimate_memory(config: TrainConfig, num_params: int) -> int:
    """The peak bytes of a training step (``plyx.train._memory.plan_memory``'s total, for the config's device).

    Weights, gradients, optimizer states, autocast's weight copies, activations saved per layer (with or
    without checkpointing) and the fused loss's logits block; within 25% of the measured peak
    (``tests/test_memory.py``).
    """
    return plan_memory(config, num_params, device_type=resolve_device(config.device).type).total


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 1 << 62


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def _checkpoint_layers(model: nn.Module) -> int:
    """Recompute each decoder layer in the backward pass (keeps only layer inputs alive)."""
    from torch.utils.checkpoint import checkpoint

    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            "$.activation_checkpointing",
            f"{type(model).__name__} has no `layers` ModuleList to checkpoint",
            value=True,
            fix="set activation_checkpointing = false for this model",
        )
    for layer in layers:
        # the instance attribute shadows the class method; parameter names (state_dict) are unchanged
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]
    return len(layers)


def _clip_on_device(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` without a host sync; the total norm as a plain 0-dim tensor.

    Parameters sharded on one rank (FSDP2 at world size 1) are DTensors: their norm is a DTensor,
    made a plain tensor (``full_tensor``: no communication on one rank) before it scales the
    gradients, as torchtitan does. Plain parameters take exactly ``clip_grad_norm_``'s path.
    """
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    full = getattr(norm, "full_tensor", None)
    if full is not None:
        norm = full()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class Trainer:
    """Trains ``config.model`` on ``config.data`` (see the module docstring).

    Args:
        config: the run (``plyx.specs.TrainConfig``).
        model: a model to train instead of building ``TransformerLM(config.model)``; it must follow
            the TransformerLM interface (``forward(..., return_hidden=True)``, ``lm_head_weight``, ``config``).
        options: how to run (``TrainOptions``).

    Raises (before any step): ``ConfigError`` for impossible settings, ``ShardError`` for missing or
    corrupt data, ``ResumeError`` for a checkpoint that does not belong to this model.

    Example:
        >>> result = Trainer(TrainConfig(steps=100), options=TrainOptions(progress=False)).fit()
        >>> result.checkpoint, result.metrics["val_loss"]
    """

    def __init__(self, config: TrainConfig, *, model: nn.Module | None = None, options: TrainOptions | None = None) -> None:
        self.config = config
        self.options = opts = options or TrainOptions()
        # distributed runs (a launcher set WORLD_SIZE): a plugin's strategy picks the device and data slice
        dist = resolve_strategy(config)
        self.device = torch.device(dist.device) if dist is not None else resolve_device(config.device)
        self.strategy = dist or LocalStrategy(opts.rank, opts.world_size, str(self.device))
        self.out_dir = Path(config.out_dir)
        self.is_main = self.strategy.is_main
        data_rank, data_world = self.strategy.data_rank, self.strategy.data_world_size
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints", keep=opts.keep_checkpoints)
        self.recovery: Recovery | None = None
        if opts.resume and self.is_main:  # a crash may have left half-written saves; clean before choosing
            self.recovery = recover(self.checkpoints.root, self.checkpoints.steps(), self.checkpoints.path_for)
        resume_from = self._resume_path()

        # -- data, tokenizer, vocabulary ------------------------------------------------
        self.data_dir = self._data_dir()
        self.shards = ShardSet.open(self.data_dir, verify=opts.verify_data)
        self.tokenizer = self._tokenizer()
        self._check_vocab()
        d = config.data
        self.train_data = TokenDataset(
            self.shards, "train", seq_len=d.seq_len, batch_size=config.batch_size, mode=d.mode,
            seed=config.seed, rank=data_rank, world_size=data_world,
        )
        self.val_data: TokenDataset | None = None
        if config.eval_every > 0:
            if "val" not in self.shards.shards or self.shards.tokens("val") == 0:
                raise ConfigError(
                    "$.eval_every", f"evaluation needs a `val` split but {self.data_dir} has none",
                    value=config.eval_every, fix="prepare the data with val_fraction > 0 or set eval_every = 0",
                )
            self.val_data = TokenDataset(
                self.shards, "val", seq_len=d.seq_len, batch_size=config.batch_size, mode=d.mode,
                seed=config.seed, rank=data_rank, world_size=data_world,
            )

        # -- model, memory, optimizer ----------------------------------------------------
        _seed_everything(config.seed)
        if model is not None and self.strategy.sharded:
            raise ConfigError(
                "$.dist.strategy", "a model passed to Trainer(model=...) cannot be sharded afterwards (FSDP builds "
                "and shards the model itself)", value=config.dist.strategy,
                fix="let the Trainer build config.model, or use strategy = 'ddp' for a model of your own",
            )
        if model is None:
            from plyx.model import TransformerLM

            # the strategy builds (meta device and shards, under plyx-dist) and initialises from the seed alone
            model = self.strategy.build_model(lambda device: TransformerLM(config.model, device=device), config.seed)
        self.module = model.to(self.device) if not self.strategy.sharded else model
        if config.neftune_alpha is not None:  # noisy embeddings in train mode only (plyx.model.adapters.neftune)
            from plyx.model.adapters import neftune

            self.neftune = neftune(self.module, config.neftune_alpha)
        if not self.strategy.sharded:
            self._check_memory()
        own_ckpt = config.activation_checkpointing and dist is None  # a strategy checkpoints before sharding
        self.ckpt_layers = _checkpoint_layers(self.module) if own_ckpt else 0
        self.optimizer = build_optimizer(self.module, config.optimizer)
        prepare = getattr(self.strategy, "prepare_optimizer", None)  # optional: a strategy may hook the step
        if prepare is not None:
            prepare(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.schedule, config.steps)
        self.step = 0
        self.run_id = uuid.uuid4().hex
        self.data_position = 0
        self.last_checkpoint: Path | None = None
        self._saved_step = -1
        self._in_flight: dict[str, tuple[int, dict[str, Any]]] = {}  # asynchronous saves not yet committed
        self._restored_rng: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        if resume_from is not None:
            self._load(resume_from)
        self.kernels = _training_kernels(config, self.device)
        self.model: nn.Module = self.module
        if config.compile:
            self.model = torch.compile(self.model)  # type: ignore[assignment]
        if opts.wrap_model is not None:
            self.model = opts.wrap_model(self.model)
        self.model = self.strategy.wrap(self.model)
        self.groups = layer_groups(self.module)
        self.flops_per_token = float(getattr(self.module, "flops_per_token", lambda t: 0.0)(d.seq_len))
        self.peak_flops = peak_flops(self.device, opts.peak_flops)
        self._stop: str | None = None
        self._signal: str | None = None  # received here; in a distributed run it stops every rank at one step

    # -- setup helpers ------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        resume = self.options.resume
        if resume == "auto":
            return self.checkpoints.latest()
        if resume:
            return CheckpointManager.resolve(resume)
        if self.checkpoints.steps() and not self.options.overwrite:
            raise ResumeError(
                f"{self.out_dir} already holds checkpoints (steps {self.checkpoints.steps()}); pass resume='auto' "
                f"(`plyx train --resume`) to continue that run, overwrite=True (`--overwrite`) to replace it, "
                f"or choose another out_dir"
            )
        return None

    def _data_dir(self) -> Path:
        return resolve_data_dir(self.config.data, self.out_dir, cache=self.options.data_cache,
                                say=lambda text: self._say(None, text))

    def _tokenizer(self) -> Tokenizer | None:
        d = self.config.data
        recorded = self.shards.manifest.get("tokenizer_sha256") or ""
        if d.tokenizer and d.tokenizer != CHAR:  # "char" was built with the data: its tokenizer.json is the one
            tok = load_tokenizer(d.tokenizer)
            if recorded and tok.sha256() != recorded:
                raise ConfigError(
                    "$.data.tokenizer",
                    f"the tokenizer is not the one the shards in {self.data_dir} were made with "
                    f"(sha256 {tok.sha256()[:12]}... vs {recorded[:12]}... in {MANIFEST})",
                    value=d.tokenizer,
                    fix="leave data.tokenizer empty to use the data's own tokenizer.json, or prepare the data again "
                        "with this tokenizer (`plyx data prepare CORPUS --tokenizer ...`)",
                )
            return tok
        path = self.shards.tokenizer_path
        return load_tokenizer(path) if path is not None else None

    def _check_vocab(self) -> None:
        model_vocab = self.config.model.vocab_size
        need = self.shards.vocab_size
        if self.tokenizer is not None:
            need = max(need, self.tokenizer.vocab_size)
        if need > model_vocab:
            raise ConfigError(
                "$.model.vocab_size",
                f"the model has {model_vocab} token ids but the tokenizer/data of {self.data_dir} use {need}",
                value=model_vocab,
                fix=f"set model.vocab_size >= {need} (or data.vocab_size <= {model_vocab} when the tokenizer is trained)",
            )
        top = int(self.shards.manifest.get("max_token_id", -1))
        if top >= model_vocab:
            raise ConfigError(
                "$.model.vocab_size", f"the shards hold token id {top}, outside the model's vocabulary",
                value=model_vocab, fix=f"set model.vocab_size >= {top + 1}",
            )

    def _check_memory(self) -> None:
        params = sum(p.numel() for p in self.module.parameters())
        plan = plan_memory(self.config, params, device_type=self.device.type)
        have = self.options.memory_bytes or _device_memory(self.device)
        if plan.total > have:
            c = self.config
            proposal = propose_fit(c, params, have, device_type=self.device.type)
            raise ConfigError(
                "$.batch_size",
                f"batch_size={c.batch_size} x data.seq_len={c.data.seq_len} with a {params:,}-parameter model needs "
                f"about {_size(plan.total)} ({plan.table()}), more than the {_size(have)} of {self.device}",
                value=c.batch_size,
                fix=f"set {proposal}" if proposal else
                    "the weights and optimizer states alone do not fit: use a smaller model, or shard it "
                    "(plyx-dist), or lower data.seq_len",
            )

    def _load(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, data position, step and (at the first step) RNG."""
        doc, tensors = CheckpointManager.read_state(path)
        saved_model = doc.get("config", {}).get("model", {})
        ours = self.config.model.to_dict()
        diffs = {k: (saved_model.get(k), v) for k, v in ours.items() if saved_model.get(k) != v}
        if diffs:
            listed = ", ".join(f"{k}: {a!r} in the checkpoint vs {b!r} here" for k, (a, b) in sorted(diffs.items()))
            raise ResumeError(
                f"checkpoint {path} belongs to another model ({listed}); resume with the checkpoint's model "
                f"config, or start a fresh run in another out_dir"
            )
        tok_sha = doc.get("tokenizer_sha256")
        if tok_sha and self.tokenizer is not None and tok_sha != self.tokenizer.sha256():
            raise ResumeError(
                f"checkpoint {path} was trained with another tokenizer than {self.data_dir}'s; resume on the "
                f"data it was trained on"
            )
        if doc["step"] > self.config.steps:
            raise ResumeError(
                f"checkpoint {path} is at step {doc['step']}, past this run's steps={self.config.steps}; raise steps"
            )
        rng = (doc["rng"], tensors)
        if isinstance(self.strategy, LocalStrategy):
            self._load_local(path, doc, tensors)
        else:  # sharded or plain, at any world size: the strategy reshards
            rng = self.strategy.load_checkpoint(path, self.module, self.optimizer) or rng
        self.scheduler.load_state_dict(doc["scheduler"])
        data = doc["data"]
        probe = self.train_data.stream()
        try:
            probe.load_state_dict(data)  # raises if the data stream would not continue identically
        except ValueError as exc:
            raise ResumeError(f"cannot resume {path}: {exc}") from None
        self.data_position = probe.position
        self.step = int(doc["step"])
        self.run_id = doc.get("run_id", self.run_id)
        self.last_checkpoint = path
        self._saved_step = self.step
        self._restored_rng = rng

    def _load_local(self, path: Path, doc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if "sharded" in doc:
            raise ResumeError(
                f"checkpoint {path} is sharded ({doc['sharded'].get('format')}, written by "
                f"{doc['sharded'].get('world_size')} ranks); resume it with plyx-dist (`plyx train CONFIG --nproc N`, "
                f"any N) or make it a plain checkpoint first with `plyx dist consolidate {path} OUT`"
            )
        # the stored tensors go straight into the module being trained: an adapted model (LoRA, DoRA) holds
        # ``lora_*`` tensors that plyx-model's load_checkpoint, which builds the bare architecture of the card,
        # rejects as unexpected; strict loading into our module checks every name and shape instead
        from plyx.model import open_checkpoint

        ckpt = open_checkpoint(path)
        ckpt.verify()  # sizes and sha256 digests first: a damaged shard is named before any tensor is read
        state = ckpt.load_state_dict("cpu")
        try:
            self.module.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ResumeError(f"checkpoint {path} does not fit this model: {exc}") from None
        self.optimizer.load_state_dict(optimizer_from_flat(doc["optimizer"], tensors))

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Run until ``config.steps`` (or a signal); returns a ``TrainResult``.

        The step's attention and compiled-norm implementations are ``config.attention`` and
        ``config.compiled_norms`` (``plyx.kernel.training_kernels``), in force for the whole run; the choice is
        the run's first log line.
        """
        from plyx.kernel import training_kernels

        c = self.config
        dtype = torch.bfloat16 if c.precision == "bf16-autocast" else torch.float32
        if self.device.type == "cpu":
            # CPU only: the step's activations are reused heap blocks, not fresh mmaps page-faulted every step
            # (plyx.train._cpu_alloc); a GPU run's tensors live in torch's CUDA caching allocator already
            tune_cpu_allocator()
        with training_kernels(c.attention, c.compiled_norms, device=self.device, dtype=dtype) as chosen:
            self._say(None, chosen.describe(compiled=c.compile))
            return self._fit()

    def _fit(self) -> TrainResult:
        c, opts = self.config, self.options
        if self._restored_rng is not None:
            restore_rng(*self._restored_rng)
        elif self.options.overwrite and self.is_main and self.checkpoints.root.is_dir():
            shutil.rmtree(self.checkpoints.root)  # a fresh run replaces the old one's checkpoints
        stream = self.train_data.stream(self.data_position)
        writer = self._metrics_writer()
        losses: list[float] = []
        last: dict[str, float] = {}
        sample = ""
        st = self.strategy
        tokens_per_step = c.batch_size * c.data.seq_len * c.grad_accum * st.data_world_size  # global
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.precision == "bf16-autocast")
        params = [p for p in self.module.parameters() if p.requires_grad]
        clip = c.optimizer.grad_clip if c.optimizer.grad_clip > 0 else math.inf
        # optional: a strategy's own no-sync clip (plyx-dist at world size 1 clips the DTensors' local tensors)
        clip_on_device = getattr(st, "clip_grad_norm_on_device", None) or _clip_on_device
        hook = get_plugin_manager().hook
        start_step = self.step
        window_t, window_steps = time.perf_counter(), 0
        timer = StepTimer()
        self._rerun_missed_hooks()
        self.model.train()
        # each step's loss and grad norm reach the host a step late on CUDA (no sync inside the step) when the
        # optimizer can skip a non-finite update on the device (fused); otherwise they are read at once
        deferred = opts.async_stats if opts.async_stats is not None else self.device.type == "cuda"
        # ranks must agree on each step's loss and on stopping at once; one rank alone (a sharded strategy at
        # world size 1 included: FSDP2 on one GPU) needs no agreement, so its step has no host sync either
        local = st.world_size == 1
        stats = StepStats(self.device, lookahead=1 if deferred and local and can_skip_update(self.optimizer) else 0)

        def emit(p: PendingStep) -> dict[str, float]:
            """Step ``p``'s metrics: the non-finite check (deferred steps), the step hook, the log line."""
            nonlocal window_t, window_steps
            loss_value, grad_norm = p.read()
            if not math.isfinite(loss_value):
                bad = int((~torch.isfinite(p.extra["step_losses"])).nonzero()[0, 0])
                raise NonFiniteLossError(p.step, "loss", loss_value, p.extra["metas"][bad], self.last_checkpoint)
            if not math.isfinite(grad_norm):
                raise NonFiniteLossError(p.step, "grad_norm", grad_norm, p.extra["metas"][-1], self.last_checkpoint)
            losses.append(loss_value)
            metrics: dict[str, float] = {
                "loss": loss_value, "lr": p.extra["lr"], "grad_norm": grad_norm,
                "tokens": float(p.step * tokens_per_step), "ms_per_step": p.extra["dt"] * 1e3,
            }
            if self.is_main:
                hook.plyx_on_train_step_end(step=p.step, metrics=metrics)
            if p.step % c.log_every == 0 or p.step == c.steps:
                elapsed = time.perf_counter() - window_t
                tps = tokens_per_step * window_steps / max(elapsed, 1e-9)
                metrics["tokens_per_s"] = tps
                if self.peak_flops and self.flops_per_token:
                    # global FLOPs over the peak of every rank's device
                    metrics["mfu"] = tps * self.flops_per_token / (self.peak_flops * st.world_size)
                metrics["peak_mem_mb"] = peak_memory_mb(self.device)
                if st.world_size > 1:
                    metrics.update(self._rank_metrics(elapsed, window_steps, metrics["peak_mem_mb"]))
                metrics.update(p.extra["detail"])
                window_t, window_steps = time.perf_counter(), 0
                if bar is None:
                    self._say(None, format_log_line(p.step, metrics, timer.eta(c.steps - p.step)))
                else:
                    bar.update(bar.task_ids[0], speed=format_speed(metrics))
            if bar is not None:
                bar.update(bar.task_ids[0], completed=p.step, loss=f"{loss_value:.4f}")
            return metrics

        with self._signals(), self._progress(start_step, timer) as bar:
            try:
                while self.step < c.steps and self._stop is None:
                    t0 = time.perf_counter()
                    micro: list[torch.Tensor] = []
                    metas = []
                    # the sync-free path: nothing from the batch's transfer to the loss and norm asks the host (sync_debug)
                    with no_sync(self.device, enabled=opts.sync_debug and bool(stats.lookahead)):
                        for i in range(c.grad_accum):
                            batch = to_device(next(stream), self.device)
                            # gradients are synchronised across ranks after the last micro-batch only (no_sync)
                            with st.micro_batch(self.model, last=i == c.grad_accum - 1):
                                with autocast:
                                    loss = st.loss(self.model, batch, label_smoothing=opts.label_smoothing,
                                                   z_loss=opts.z_loss)
                                    if loss is None:
                                        loss = lm_loss(self.model, batch, label_smoothing=opts.label_smoothing,
                                                       z_loss=opts.z_loss)
                                (loss / c.grad_accum).backward()
                            micro.append(loss.detach())
                            metas.append(batch.meta)
                        step_losses = torch.stack(micro)
                        loss_mean = step_losses.mean()
                        if stats.lookahead:  # the device skips a non-finite update; the host learns of it a step later
                            grad_norm_t = clip_on_device(params, clip)
                            skip_update(self.optimizer, loss_mean, grad_norm_t)
                        else:
                            loss_value = float(loss_mean)  # a CPU-GPU sync point, once per step
                            rank_loss = loss_value
                            # the global batch's loss, and whether any rank got a signal: all ranks stop after one step
                            loss_value, signalled = st.reduce_mean([loss_value, 1.0 if self._signal else 0.0])
                            if signalled and self._stop is None:
                                self._stop = self._signal or "SIGTERM"
                            if not math.isfinite(loss_value):
                                bad = int((~torch.isfinite(step_losses)).nonzero()[0, 0]) if not math.isfinite(rank_loss) else 0
                                raise NonFiniteLossError(self.step + 1, "loss", loss_value, metas[bad], self.last_checkpoint)
                            grad_norm = st.clip_grad_norm(params, clip)
                            if not math.isfinite(grad_norm):
                                raise NonFiniteLossError(self.step + 1, "grad_norm", grad_norm, metas[-1],
                                                         self.last_checkpoint)
                            loss_mean, grad_norm_t = torch.tensor(loss_value), torch.tensor(grad_norm)
                    detail = self._detail_metrics() if not st.sharded else {}  # logging steps: reads norms
                    lr = self.scheduler.get_last_lr()[0]
                    with no_sync(self.device, enabled=opts.sync_debug and bool(stats.lookahead)):
                        self.optimizer.step()
                        self.scheduler.step()
                        self.optimizer.zero_grad(set_to_none=True)
                    self.step += 1
                    self.data_position = stream.position
                    dt = time.perf_counter() - t0
                    timer.update(dt)
                    window_steps += 1
                    stats.push(self.step, loss_mean, grad_norm_t, lr=lr, dt=dt, detail=detail, metas=metas,
                               step_losses=step_losses)
                    evaluating = bool(c.eval_every and (self.step % c.eval_every == 0 or self.step == c.steps))
                    due = (evaluating or self.step % c.log_every == 0 or self.step == c.steps or self._stop is not None
                           or bool(c.checkpoint_every and self.step % c.checkpoint_every == 0))
                    metrics: dict[str, float] = {}
                    for pending in stats.ready(flush=due):  # earlier steps' scalars (all of them when due)
                        metrics = emit(pending)
                        last.update(metrics)
                    if evaluating:
                        t_eval = time.perf_counter()
                        metrics.update(self.evaluate())
                        sample = self.sample()
                        shown = f"\n{sample}" if self.step < c.steps else ""  # the final sample is the result's
                        self._say(bar, f"step {self.step}: val_loss {metrics['val_loss']:.4f} "
                                       f"(ppl {metrics['val_ppl']:.2f}){shown}")
                        window_t += time.perf_counter() - t_eval  # evaluation is not training throughput
                        last.update(metrics)
                    if due and writer is not None and ("tokens_per_s" in metrics or "val_loss" in metrics):
                        writer.write(self.step, metrics)
                    if c.checkpoint_every and self.step % c.checkpoint_every == 0 and self.step < c.steps:
                        t_save = time.perf_counter()
                        self.save(last)
                        window_t += time.perf_counter() - t_save  # nor is checkpointing
                    self._collect_checkpoints(wait=False)  # an asynchronous save that completed meanwhile
                for pending in stats.ready(flush=True):
                    last.update(emit(pending))
                if self._saved_step != self.step:  # the final (or interrupted) state, unless just saved
                    self.save(last)
                self._collect_checkpoints(wait=True)  # the run ends with its last checkpoint committed
                if self._stop is not None:
                    self._say(bar, f"{self._stop}: checkpoint {self.last_checkpoint} written at step {self.step}")
            finally:
                if writer is not None:
                    writer.close()
        if not sample and c.sample_tokens and self._stop is None:
            sample = self.sample()
        st.barrier()  # no rank leaves while another still writes or reduces
        if self.is_main:
            hook.plyx_on_train_end(out_dir=str(self.out_dir), metrics=dict(last), metadata=self._metadata(last))
        return TrainResult(
            step=self.step, losses=losses, metrics=dict(last), checkpoint=self.last_checkpoint, sample=sample,
            stopped=self._stop, out_dir=self.out_dir,
        )

    def _rank_metrics(self, elapsed: float, steps: int, peak_mb: float) -> dict[str, float]:
        """Per-rank throughput and peak memory (rank 0 writes them): the slowest and largest rank bound the run."""
        c, st = self.config, self.strategy
        mine = c.batch_size * c.data.seq_len * c.grad_accum * steps / max(elapsed, 1e-9)
        out: dict[str, float] = {}
        for key, value in (("tokens_per_s", mine), ("peak_mem_mb", peak_mb)):
            for rank, v in enumerate(st.gather(value)):
                out[f"{key}/rank{rank}"] = v
        comm = getattr(st, "comm_share", None)
        if callable(comm):
            out["allreduce_share"] = float(comm())
        return out

    def _detail_metrics(self) -> dict[str, float]:
        """Per-layer gradient norms on logging steps; the spectral probe when due (before the update)."""
        c, opts = self.config, self.options
        out: dict[str, float] = {}
        next_step = self.step + 1
        if next_step % c.log_every == 0 or next_step == c.steps:
            out.update({f"grad_norm/{k}": v for k, v in grad_norms_by_group(self.groups).items()})
            router = getattr(self.module, "router_metrics", None)  # MoE: tokens per expert, imbalance, drops
            out.update(router() if router is not None else {})
        if opts.spectral_probe_every and next_step % opts.spectral_probe_every == 0:
            for key, ratio in spectral_ratios(self.groups).items():
                out[f"spectral_ratio/{key}"] = ratio
                low, high = SPECTRAL_RANGE
                if not low <= ratio <= high:
                    self._say(None, f"warning: step {next_step}: {key} MLP/attention spectral-norm ratio {ratio:.2f} "
                                    f"is outside [{low}, {high}]")
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first ``eval_steps`` validation batches (the same ones every time) and its perplexity."""
        if self.val_data is None:
            return {}
        c = self.config
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.precision == "bf16-autocast")
        was = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for i in range(c.eval_steps):
                batch = self.val_data.batch(i).to(self.device)
                with autocast:
                    loss = self.strategy.loss(self.model, batch)  # None: the plain loss
                    total += (loss if loss is not None else lm_loss(self.model, batch)).double()
        finally:
            self.model.train(was)
        val = self.strategy.reduce_mean([float(total) / c.eval_steps])[0]
        return {"val_loss": val, "val_ppl": math.exp(min(val, 700.0))}

    def sample(self) -> str:
        """A sample of ``sample_tokens`` tokens, decoded with the run's tokenizer (ids when there is none)."""
        c, opts = self.config, self.options
        if not c.sample_tokens or not self.strategy.can_sample:
            return ""
        gen = torch.Generator().manual_seed(c.seed + self.step)
        tok = self.tokenizer
        prompt = tok.encode(opts.sample_prompt) if tok and opts.sample_prompt else []
        if not prompt:
            prompt = [tok.eos_id] if tok else [0]
        ids = generate_ids(self.module, prompt, c.sample_tokens, temperature=opts.sample_temperature,
                           top_k=opts.sample_top_k, generator=gen)
        if tok is None:
            return " ".join(map(str, ids))
        text = tok.decode(ids[1:] if prompt == [tok.eos_id] else ids)  # the prompt text stays in the sample
        separator = self.shards.manifest.get("source", {}).get("separator")
        return text.replace(tok.eos_token, separator) if separator else text

    # -- checkpoints --------------------------------------------------------------------
    def save(self, metrics: dict[str, float] | None = None) -> Path | None:
        """Checkpoint the current step atomically (rank 0, or every rank with a strategy's sharded
        checkpoint) and fire ``plyx_on_checkpoint_saved`` (rank 0).

        Returns the checkpoint's directory. A strategy that saves in the background
        (``async_checkpoints``: plyx-dist's ``dist.async_save``) returns before the directory exists; the
        hook fires and ``last_checkpoint`` moves when it is committed (``fit`` ends with it committed).
        """
        local = isinstance(self.strategy, LocalStrategy)
        if local and not self.is_main:
            return None
        metrics = dict(metrics or {})
        state = {
            "run_id": self.run_id,
            "config": self.config.to_dict(),
            "data": self.train_data.stream(self.data_position).state_dict(),
            "data_dir": str(self.data_dir),
            "tokenizer_sha256": self.tokenizer.sha256() if self.tokenizer else "",
            "metrics": metrics,
        }
        card = {
            "training": {"steps": self.step, "tokens": metrics.get("tokens"), "loss": metrics.get("loss"),
                         "val_loss": metrics.get("val_loss"), "run_id": self.run_id},
        }
        card.update(self._card(metrics))
        extra_files: dict[str, Any] = {}
        if self.tokenizer is not None:
            card["tokenizer"] = "tokenizer.json"
            extra_files["tokenizer_config.json"] = tokenizer_config(
                eos_token=self.tokenizer.eos_token, max_len=self.config.model.max_seq_len)
        tokenizer_file = self.tokenizer.path if self.tokenizer else None
        if local:
            path = self.checkpoints.save(
                self.step, self.module, optimizer=self.optimizer, scheduler=self.scheduler, state=state,
                card_fields=card, tokenizer_file=tokenizer_file, extra_files=extra_files,
            )
        else:  # every rank writes its shards; the strategy commits (tokenizer_config.json comes with consolidate)
            path = self.strategy.save_checkpoint(self.checkpoints, self.step, self.module, self.optimizer,
                                                 self.scheduler, state=state, card_fields=card,
                                                 tokenizer_file=tokenizer_file)
        self._saved_step = self.step
        if getattr(self.strategy, "async_checkpoints", False):
            # written in the background (plyx-dist's dist.async_save): the checkpoint exists, and its hook
            # fires, once the strategy has committed it (_collect_checkpoints)
            meta = self._metadata(metrics) if self.is_main else {}
            if self.is_main:
                meta["outputs"] = {**meta["outputs"], "checkpoint": str(path)}
            self._in_flight[str(path)] = (self.step, meta)
            self._collect_checkpoints(wait=False)  # the previous save, which the strategy committed first
            return path
        self.last_checkpoint = path
        meta = self._metadata(metrics) if self.is_main else {}
        if self.is_main:
            meta["outputs"] = {"checkpoint": str(path), **meta["outputs"]}
        self._committed(path, self.step, meta)
        return path

    def _committed(self, path: Path, step: int, meta: dict[str, Any]) -> None:
        """A checkpoint is in place: it is the one to fall back to, and rank 0 fires ``plyx_on_checkpoint_saved``."""
        self.last_checkpoint = path
        if not self.is_main:
            return
        get_plugin_manager().hook.plyx_on_checkpoint_saved(path=str(path), step=step, metadata=meta)
        mark_hooked(path)  # a kill before this line gets the hook re-run on resume (_recovery)

    def _collect_checkpoints(self, *, wait: bool) -> None:
        """Hand the strategy's asynchronously written checkpoints that it committed since the last call to
        ``_committed`` (``wait``: block for the one in flight, at the end of ``fit``)."""
        collect = getattr(self.strategy, "committed_checkpoints", None)
        if collect is None or not self._in_flight:
            return
        for path in collect(wait=wait):
            step, meta = self._in_flight.pop(str(path), (self.step, {}))  # (its save's step and metadata)
            self._committed(Path(path), step, meta or self._metadata({}))

    def _card(self, metrics: dict[str, float]) -> dict[str, Any]:
        """The card's fields: ``TrainOptions`` (the command line) first, then the config's ``[card]``, then derived."""
        o, card = self.options, self.config.card
        return card_fields(
            run_name=self.out_dir.resolve().name, config=self.config, num_params=self.module_params(),
            step=self.step, metrics=metrics, data_dir=self.data_dir, source=self.shards.manifest.get("source", {}),
            name=o.name or card.name or None, license=o.license or card.license or None,
            description=o.description or card.description or None,
        )

    def module_params(self) -> int:
        """Parameters of the model being trained (each tensor once)."""
        return sum(p.numel() for p in self.module.parameters())

    def _rerun_missed_hooks(self) -> None:
        """Fire ``plyx_on_checkpoint_saved`` for complete checkpoints a crash left without it (see _recovery)."""
        if self.recovery is None or not self.is_main:
            return
        rerun_saved_hooks(self.recovery.unhooked, get_plugin_manager().hook, data_dir=self.data_dir,
                          out_dir=self.out_dir, seed=self.config.seed)
        if self.recovery.summary():
            self._say(None, f"resume: {self.recovery.summary()}")

    def _metadata(self, metrics: dict[str, float]) -> dict[str, Any]:
        inputs = {"data": str(self.data_dir), "manifest": str(self.data_dir / MANIFEST)}
        if self.tokenizer is not None and self.tokenizer.path is not None:
            inputs["tokenizer"] = str(self.tokenizer.path)
        outputs = {"metrics": str(self.out_dir / "metrics.csv")}
        if self.last_checkpoint is not None:
            outputs["checkpoint"] = str(self.last_checkpoint)
        return {
            "config": self.config.to_dict(),
            "seeds": {"seed": self.config.seed, "data_seed": self.config.seed},
            "inputs": inputs,
            "outputs": outputs,
            "metrics": dict(metrics),
            "run_id": self.run_id,
            "step": self.step,
        }

    # -- terminal, files, signals --------------------------------------------------------
    def _metrics_writer(self) -> MetricsWriter | None:
        if not self.is_main:
            return None
        extra = [f"grad_norm/{k}" for k in self.groups]
        world = self.strategy.world_size
        if world > 1:  # per-rank throughput and memory, and the DDP all-reduce share (_rank_metrics)
            extra += [f"{k}/rank{r}" for k in ("tokens_per_s", "peak_mem_mb") for r in range(world)]
            extra.append("allreduce_share")
        if self.options.spectral_probe_every:
            extra += [f"spectral_ratio/{k}" for k in self.groups if k.split(".")[-1].isdigit()]
        if getattr(self.config.model, "moe", None) is not None:  # router statistics columns (plyx-model >= 1.3)
            import plyx.model

            extra += list(getattr(plyx.model, "ROUTER_METRICS", ()))
        return MetricsWriter(self.out_dir, extra, resume_step=self.step if self.step else None,
                             tensorboard=self.options.tensorboard)

    @contextlib.contextmanager
    def _progress(self, start: int, timer: StepTimer) -> Iterator[Any]:
        """The bar on a terminal when progress is on; None (log lines through ``print_fn``) otherwise."""
        if not (self.is_main and use_bar(self.options.progress)):
            yield None
            return
        with progress_bar(self.config.steps, start, timer) as progress:
            yield progress

    def _say(self, bar: Any, text: str) -> None:
        if not self.is_main:
            return
        if bar is not None:
            bar.console.print(text)
        elif self.options.print_fn is not None:
            self.options.print_fn(text)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM finish the current step, then checkpoint and stop (a second SIGINT aborts)."""
        if not self.options.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._signal = signal.Signals(signum).name
            if isinstance(self.strategy, LocalStrategy) or self.strategy.world_size == 1:
                self._stop = self._signal  # alone: stop at the next step boundary

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _training_kernels(config: TrainConfig, device: torch.device) -> Any:
    """``config.attention`` / ``config.compiled_norms`` resolved for ``device`` (``plyx.kernel``'s rule); a choice
    the device cannot run is a ``ConfigError`` before any step (the config's own check knows no device for "auto")."""
    from plyx.kernel import resolve_training_kernels

    dtype = torch.bfloat16 if config.precision == "bf16-autocast" else torch.float32
    try:
        return resolve_training_kernels(config.attention, config.compiled_norms, device=device, dtype=dtype)
    except ValueError as exc:
        raise ConfigError("$.attention", str(exc), value=config.attention,
                          fix='attention = "auto" picks what the device runs') from None
