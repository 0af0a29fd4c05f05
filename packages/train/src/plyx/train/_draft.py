"""``plyx train`` with a ``[draft]`` table: Medusa heads or an EAGLE draft trained on a frozen base.

The base checkpoint (``draft.base``) is loaded, frozen (``requires_grad_(False)``, eval mode) and run
under ``torch.no_grad`` for its hidden states; only the heads' parameters reach the optimizer. Data,
optimizer and schedule are the run's (``data``, ``optimizer``, ``schedule``); ``model`` is ignored (the
base's own config is used). Every ``log_every`` steps the loss and each head's top-1 accuracy are
logged (``metrics.csv``, TensorBoard, the console); the heads are written to ``out_dir/draft-heads``
at the end, or when the run is interrupted (Ctrl-C: saved, then stopped), atomically.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from plyx.specs import ConfigError, TrainConfig

__all__ = ["DraftResult", "DraftTrainer"]

HEADS_DIR = "draft-heads"


@attrs.frozen
class DraftResult:
    """What ``DraftTrainer.fit`` did: last step, per-step losses, last metrics, the heads' directory,
    and ``"SIGINT"`` when interrupted (None when complete)."""

    step: int
    losses: list[float]
    metrics: dict[str, float]
    heads: Path
    stopped: str | None


class DraftTrainer:
    """Trains the draft heads of ``config.draft`` on the frozen base it names.

    Args:
        config: a ``TrainConfig`` with a ``draft`` table.
        progress: a rich bar on a terminal (elsewhere a line every ``log_every`` steps).
        tensorboard: also write TensorBoard events.
        print_fn: where lines go (None: silent).
        data_cache: where the bundled corpus is prepared (as ``TrainOptions.data_cache``).

    Raises:
        ConfigError: no draft table, a base that is not a checkpoint, data outside the base's vocabulary.

    Example:
        >>> cfg = TrainConfig.from_dict({"draft": {"kind": "medusa", "base": "runs/x/checkpoints/latest"}})
        >>> DraftTrainer(cfg).fit().heads
    """

    def __init__(self, config: TrainConfig, *, progress: bool = True, tensorboard: bool = True,
                 print_fn: Callable[[str], None] | None = None, data_cache: str | None = None) -> None:
        from plyx.model import CheckpointError, build_draft_heads, load_checkpoint
        from plyx.train._dataset import TokenDataset
        from plyx.train._datasource import resolve_data_dir
        from plyx.train._optim import build_optimizer
        from plyx.train._schedule import build_scheduler
        from plyx.train._shards import ShardSet
        from plyx.train._trainer import _seed_everything, resolve_device

        if config.draft is None:
            raise ConfigError("draft", "DraftTrainer needs a [draft] table", fix='add [draft] with kind and base')
        self.config = config
        self.draft = d = config.draft
        self.progress, self.tensorboard, self.print_fn = progress, tensorboard, print_fn
        self.device = resolve_device(config.device)
        self.out_dir = Path(config.out_dir)
        try:
            base = load_checkpoint(d.base, device=self.device)
        except (CheckpointError, FileNotFoundError, NotADirectoryError) as exc:
            raise ConfigError("draft.base", f"the base {d.base!r} cannot be loaded as a checkpoint: {exc}",
                              value=d.base, fix="point draft.base at a plyx or Hugging Face checkpoint directory "
                              "(e.g. runs/NAME/checkpoints/latest)") from None
        self.base = base.eval().requires_grad_(False)
        bc = self.base.config
        if config.data.seq_len > bc.max_seq_len:
            raise ConfigError("data.seq_len", f"sequences of {config.data.seq_len} tokens do not fit the base's "
                              f"max_seq_len ({bc.max_seq_len})", value=config.data.seq_len,
                              fix=f"set data.seq_len <= {bc.max_seq_len}")
        self.data_dir = resolve_data_dir(config.data, self.out_dir, cache=data_cache)
        self.shards = ShardSet.open(self.data_dir)
        top = max(self.shards.vocab_size, int(self.shards.manifest.get("max_token_id", -1)) + 1)
        if top > bc.vocab_size:
            raise ConfigError("data", f"the data of {self.data_dir} uses {top} token ids but the base's vocabulary "
                              f"has {bc.vocab_size}", value=str(self.data_dir),
                              fix="train the heads on data tokenized with the base's tokenizer (data.path, data.tokenizer)")
        data = config.data
        self.train_data = TokenDataset(self.shards, "train", seq_len=data.seq_len, batch_size=config.batch_size,
                                       mode=data.mode, seed=config.seed)
        has_val = "val" in self.shards.shards and self.shards.tokens("val") > 0
        self.val_data = TokenDataset(self.shards, "val", seq_len=data.seq_len, batch_size=config.batch_size,
                                     mode=data.mode, seed=config.seed) if has_val and config.eval_every else None
        _seed_everything(config.seed)
        # float32 master weights whatever the base's dtype; serving casts them to the base's
        self.heads = build_draft_heads(d.kind, bc, num_heads=d.num_heads, num_layers=d.num_layers,
                                       device=self.device, dtype=torch.float32)
        self.heads.init_from_base(self.base)
        self.optimizer = build_optimizer(self.heads, config.optimizer)
        self.scheduler = build_scheduler(self.optimizer, config.schedule, config.steps)
        self.step = 0
        n = d.num_heads if d.kind == "medusa" else 1
        self.acc_names = [f"acc/head{k}" for k in range(1, n + 1)]

    # -- one batch -------------------------------------------------------------------------
    def loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The draft loss of one ``Batch`` and its metrics (per-head top-1 accuracy, EAGLE's parts)."""
        from plyx.train._draft_loss import IGNORE_INDEX, eagle_loss, medusa_loss

        dev = self.device
        ids = batch.input_ids.to(dev)
        targets = batch.targets.to(dev)
        docs = None if batch.document_ids is None else batch.document_ids.to(dev)
        pos = None if batch.position_ids is None else batch.position_ids.to(dev)
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16-autocast")
        with torch.no_grad(), autocast:  # the frozen base: features only
            hidden = self.base(ids, position_ids=pos, document_ids=docs, return_hidden=True)  # (B, T, D)
        d = self.draft
        with autocast:
            if d.kind == "medusa":
                teacher = None
                if d.targets == "base":  # self-distillation: the base's own next-token logits as soft labels
                    with torch.no_grad():
                        teacher = hidden.float() @ self.base.lm_head_weight.float().t()  # (B, T, V)
                loss, acc = medusa_loss(self.heads(hidden.float()), targets, decay=d.decay, document_ids=docs,
                                        teacher_logits=teacher)
                return loss, dict(zip(self.acc_names, acc))
            # entry i = [embed(x_{i+1}); f_i] -> f_{i+1}, i = 0..T-2 (teacher forcing on the base's features)
            feats = hidden[:, :-1].float()
            if self.heads.training and d.feature_noise > 0:
                feats = feats + (torch.rand_like(feats) * 2 - 1) * d.feature_noise
            pred = self.heads(ids[:, 1:], feats, self.base.embed_tokens.weight.float(),
                              document_ids=None if docs is None else docs[:, :-1],
                              position_ids=None if pos is None else pos[:, :-1])  # (B, T-1, D)
            mask = targets[:, :-1] != IGNORE_INDEX  # x_{i+1} is in position i's document
            if docs is not None:
                mask &= docs[:, :-1] == docs[:, 1:]
            loss, parts = eagle_loss(pred, hidden[:, 1:], self.base.lm_head_weight, cls_weight=d.cls_weight,
                                     mask=mask)
        return loss, {"acc/head1": parts["accuracy"], "reg": parts["reg"], "cls": parts["cls"]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean val loss and per-head accuracy over ``eval_steps`` batches (empty without a val split)."""
        if self.val_data is None:
            return {}
        self.heads.eval()
        sums: dict[str, float] = {}
        for i in range(self.config.eval_steps):
            loss, metrics = self.loss(self.val_data.batch(i))
            for key, value in {"loss": loss, **metrics}.items():
                sums[f"val_{key}"] = sums.get(f"val_{key}", 0.0) + float(value)
        self.heads.train()
        return {k: v / self.config.eval_steps for k, v in sums.items()}

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> DraftResult:
        """Train ``steps`` optimizer steps (Ctrl-C: save and stop); returns a ``DraftResult``."""
        from plyx.train._metrics import MetricsWriter
        from plyx.train._progress import StepTimer, progress_bar, use_bar

        c = self.config
        writer = MetricsWriter(self.out_dir, extra_columns=["loss", "lr", *self.acc_names, "reg", "cls",
                                                            *(f"val_{n}" for n in ["loss", *self.acc_names])],
                               tensorboard=self.tensorboard)
        params = [p for p in self.heads.parameters() if p.requires_grad]
        clip = c.optimizer.grad_clip if c.optimizer.grad_clip > 0 else math.inf
        stream = self.train_data.stream()
        losses: list[float] = []
        last: dict[str, float] = {}
        stopped: str | None = None
        timer = StepTimer()
        bar_on = use_bar(self.progress)
        self.heads.train()
        try:
            with (progress_bar(c.steps, 0, timer) if bar_on else contextlib.nullcontext()) as bar:
                while self.step < c.steps:
                    t0 = time.perf_counter()
                    self.optimizer.zero_grad(set_to_none=True)
                    total = 0.0
                    sums: dict[str, float] = {}
                    for _ in range(c.grad_accum):
                        loss, metrics = self.loss(next(stream))
                        (loss / c.grad_accum).backward()
                        total += float(loss.detach()) / c.grad_accum
                        for key, value in metrics.items():
                            sums[key] = sums.get(key, 0.0) + float(value) / c.grad_accum
                    if not math.isfinite(total):
                        raise FloatingPointError(f"draft loss is {total} at step {self.step + 1}; lower optimizer.lr")
                    torch.nn.utils.clip_grad_norm_(params, clip)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.step += 1
                    losses.append(total)
                    timer.update(time.perf_counter() - t0)
                    if self.step % c.log_every == 0 or self.step == c.steps:
                        last = {"loss": total, "lr": self.scheduler.get_last_lr()[0], **sums}
                        if c.eval_every and (self.step % c.eval_every == 0 or self.step == c.steps):
                            last.update(self.evaluate())
                        writer.write(self.step, last)
                        line = _line(self.step, last, self.acc_names)
                        if bar is not None:
                            bar.update(bar.tasks[0].id, completed=self.step, loss=f"{total:.4f}", speed=line)
                        elif self.print_fn is not None:
                            self.print_fn(line)
                    elif bar is not None:
                        bar.update(bar.tasks[0].id, completed=self.step, loss=f"{total:.4f}")
        except KeyboardInterrupt:
            stopped = "SIGINT"  # the heads so far are saved below; the run can be started again
        finally:
            writer.close()
        heads = self.save(last)
        return DraftResult(step=self.step, losses=losses, metrics=last, heads=heads, stopped=stopped)

    def save(self, metrics: dict[str, float] | None = None) -> Path:
        """Write the heads to ``out_dir/draft-heads`` (atomic) with the base's path, step and metrics."""
        from plyx.model import save_draft_heads

        return save_draft_heads(self.heads, self.out_dir / HEADS_DIR, base=self.draft.base,
                                extra={"step": self.step, "metrics": metrics or {}})


def _line(step: int, metrics: dict[str, float], names: list[str]) -> str:
    acc = " ".join(f"h{k + 1} {metrics[n]:.3f}" for k, n in enumerate(names) if n in metrics)
    text = f"step {step} | loss {metrics['loss']:.4f} | acc {acc}"
    val = " ".join(f"h{k + 1} {metrics['val_' + n]:.3f}" for k, n in enumerate(names) if "val_" + n in metrics)
    return text + (f" | val acc {val}" if val else "")

