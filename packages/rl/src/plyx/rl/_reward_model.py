"""Reward models: a scalar head on the plyx ``TransformerLM``, trained on preference pairs (Bradley-Terry).

The model (``RewardModel``): the backbone's final (normed) hidden state at each row's last real token,
through ``score``, a ``[1, D]`` linear layer without bias (Hugging Face's ``*ForSequenceClassification``
with one label). Rows are right-padded and the last real token is found from the row lengths, not by
comparing with the pad id (the pad id is usually the end-of-text id, which ends every completion).

The loss (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1; the margin of Touvron et al. 2023, Llama 2,
eq. 2): for a pair with chosen reward ``r_c`` and rejected reward ``r_r``,
``-log sigmoid(r_c - r_r - m)`` with ``m`` = the config's ``margin`` plus the record's own ``margin`` field;
optionally ``+ c * mean((r_c + r_r)^2)`` (``center_rewards_coefficient``, Eisenstein et al. 2023, as TRL's
``RewardTrainer``), which keeps rewards centred on 0. Reported: loss, accuracy (``r_c > r_r``), mean
margin, and the held-out pair accuracy of ``eval_data`` before and after training.

A trained reward model is a directory: a plyx checkpoint of the backbone, ``score.safetensors`` (the head),
``reward_model.json``, ``tokenizer.json`` (and the chat template). ``reward_model_reward(dir)`` turns it into
a GRPO reward function (``fn(prompts, completions, **columns) -> list[float]``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from plyx.rl._chat import ChatTemplate, ChatTemplateError, load_chat_template, strip_generation_tags
from plyx.rl._config import RunConfig
from plyx.rl._data import DataError, PairExample, TokenizedData, _Encoder, tokenize_pairs
from plyx.rl._run import RunResult, _atomic_json, _begin, _fit
from torch import nn

__all__ = ["RewardModel", "RewardModelConfig", "bradley_terry_loss", "load_reward_model", "pair_accuracy",
           "reward_model_reward", "score_rows", "train_reward_model"]

#: files of a reward-model directory beside the backbone's checkpoint
HEAD_FILE = "score.safetensors"
META_FILE = "reward_model.json"


class RewardModelConfig(RunConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``plyx rl rm``: a reward model trained on preference pairs (``prompt``, ``chosen``, ``rejected``)."""

    SCHEMA = "rl.rm"
    VERSION = 1

    margin: float = 0.0
    """Margin added to every pair's (with the record's own ``margin`` field): ``-log sigmoid(r_c - r_r - m)``."""
    center_rewards_coefficient: float = 0.0
    """Weight of ``mean((r_c + r_r)^2)``, which centres rewards on 0 (0: off)."""
    eval_data: str = ""
    """Held-out pairs (JSONL, same format): pair accuracy before and after (empty: none)."""
    out_dir: str = "runs/rm"
    """Where reward_model/, metrics.jsonl, eval.json and data_report.json go."""


class RewardModel(nn.Module):
    """A ``TransformerLM`` backbone and a scalar ``score`` head on the last real token of each row."""

    def __init__(self, backbone: nn.Module, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.backbone = backbone
        d_model = int(backbone.config.d_model)
        self.score = nn.Linear(d_model, 1, bias=False, device=next(backbone.parameters()).device)
        nn.init.normal_(self.score.weight, std=init_std)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards ``[B]`` of right-padded rows ``input_ids [B, T]`` whose real tokens number ``lengths [B]``."""
        hidden = self.backbone(input_ids, return_hidden=True)  # (B, T, D)
        last = (lengths.to(hidden.device) - 1).clamp(min=0)  # (B,)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, D)
        return self.score(picked.to(self.score.weight.dtype)).squeeze(-1).float()  # (B,)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None,
                       center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    """``mean(-log sigmoid(r_c - r_r - margin)) + c * mean((r_c + r_r)^2)``.

    Args:
        chosen: ``[B]`` rewards of the chosen completions.
        rejected: ``[B]`` rewards of the rejected completions.
        margin: ``[B]`` or a scalar (None: 0).
        center_rewards_coefficient: ``c`` (0: off).
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected).square().mean()
    return loss


def _rows(seqs: Sequence[Sequence[int]], pad_id: int, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` ids and ``[B]`` lengths; rows longer than ``max_len`` keep their end."""
    seqs = [list(s)[-max_len:] if max_len else list(s) for s in seqs]
    width = max(max(len(s) for s in seqs), 1)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([max(len(s), 1) for s in seqs], dtype=torch.long)


def score_rows(model: RewardModel, seqs: Sequence[Sequence[int]], pad_id: int, batch_size: int = 16) -> torch.Tensor:
    """Rewards ``[N]`` of token sequences, ``batch_size`` rows per forward, without gradients."""
    device = next(model.parameters()).device
    out = []
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(seqs), batch_size):
                ids, lengths = _rows(seqs[i: i + batch_size], pad_id, int(model.config.max_seq_len))
                out.append(model(ids.to(device), lengths.to(device)).cpu())
    finally:
        model.train(was)
    return torch.cat(out) if out else torch.empty(0)


def pair_accuracy(model: RewardModel, pairs: Sequence[PairExample], pad_id: int) -> float:
    """Share of pairs whose chosen completion gets the higher reward (ties count as wrong)."""
    chosen = score_rows(model, [p.prompt + p.chosen for p in pairs], pad_id)
    rejected = score_rows(model, [p.prompt + p.rejected for p in pairs], pad_id)
    return float((chosen > rejected).float().mean()) if len(pairs) else float("nan")


def _save(model: RewardModel, config: RewardModelConfig, tokenizer: Any, template: ChatTemplate | None,
          out_dir: Path, card: dict[str, Any]) -> Path:
    """Write ``reward_model/`` atomically: the backbone checkpoint, the head, the tokenizer and the template."""
    from plyx.model import save_checkpoint
    from safetensors.torch import save_file

    backbone = model.backbone
    if config.adapter is not None:
        from plyx.model.adapters import merge_and_unload

        backbone = merge_and_unload(copy.deepcopy(backbone))
    final = out_dir / "reward_model"
    tmp = out_dir / f".reward_model.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(backbone, tmp, card_fields={"name": "plyx-rl-reward-model", "training": card})
    save_file({"weight": model.score.weight.detach().float().cpu().contiguous()}, str(tmp / HEAD_FILE))
    (tmp / META_FILE).write_text(json.dumps({"format": "plyx-reward-model", "version": 1, "head": HEAD_FILE,
                                             "pad_id": int(tokenizer.eos_id), "pooling": "last_token"}, indent=2))
    tokenizer.save(tmp / "tokenizer.json")
    if template is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": strip_generation_tags(template.source), "eos_token": tokenizer.eos_token,
            "bos_token": template.bos_token or None, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_reward_model(path: str | os.PathLike[str], *, device: Any = "cpu") -> tuple[RewardModel, Any,
                                                                                     ChatTemplate | None]:
    """``(RewardModel, tokenizer, chat template or None)`` of a directory written by ``plyx rl rm``."""
    from plyx.model import load_checkpoint
    from plyx.train import load_tokenizer
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / META_FILE).is_file():
        raise FileNotFoundError(f"{str(root)!r} is not a reward model (no {META_FILE}); pass the reward_model/ "
                                "directory a `plyx rl rm` run wrote")
    backbone = load_checkpoint(root, device=device, dtype="float32")
    model = RewardModel(backbone)
    head = load_file(str(root / HEAD_FILE))["weight"]  # safetensors: no pickle
    if tuple(head.shape) != tuple(model.score.weight.shape):
        raise DataError(f"{root / HEAD_FILE}: head of shape {tuple(head.shape)}, the backbone needs "
                        f"{tuple(model.score.weight.shape)}")
    with torch.no_grad():
        model.score.weight.copy_(head)
    model.eval()
    tokenizer = load_tokenizer(root / "tokenizer.json")
    try:
        template = load_chat_template(root, "")
    except ChatTemplateError:  # no template is fine for plain-text prompts
        template = None
    return model, tokenizer, template


def reward_model_reward(checkpoint: str, *, device: str = "cpu", batch_size: int = 8,
                        **_: Any) -> Callable[..., list[float | None]]:
    """A GRPO reward function (TRL's batch signature) scoring each prompt + completion with a reward model.

    Args:
        checkpoint: a ``reward_model/`` directory written by ``plyx rl rm``.
        device: where the reward model runs.
        batch_size: rows per forward.

    Returns:
        ``fn(prompts, completions, **columns) -> list[float]``; prompts are strings (encoded as they are) or
        chat message lists (rendered with the reward model's template), completions strings.

    Example:
        >>> fn = reward_model_reward("runs/rm/reward_model")
        >>> fn(["add 2 3 ="], [" 5"])
    """
    model, tokenizer, template = load_reward_model(checkpoint, device=device)
    enc = _Encoder(tokenizer, template)
    pad = int(tokenizer.eos_id)

    def reward(prompts: Sequence[Any], completions: Sequence[Any], **_columns: Any) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; pass one prompt per "
                             "completion (repeat each prompt for its group)")
        seqs = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            pi, ci = enc.prompt_completion(p, c, f"reward_model sample {i}")
            seqs.append(pi + ci)
        return [float(x) for x in score_rows(model, seqs, pad, batch_size)]

    return reward


@attrs.frozen
class _PairBatch:
    ids: torch.Tensor  # (2B, T): chosen rows, then rejected rows
    lengths: torch.Tensor  # (2B,)
    margins: torch.Tensor  # (B,)


def _collate(pairs: Sequence[PairExample], pad_id: int, max_len: int) -> _PairBatch:
    seqs = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    ids, lengths = _rows(seqs, pad_id, max_len)
    return _PairBatch(ids, lengths, torch.tensor([p.margin for p in pairs], dtype=torch.float32))


def train_reward_model(config: RewardModelConfig, *, model: nn.Module | None = None, tokenizer: Any = None,
                       template: ChatTemplate | None = None, overwrite: bool = False, progress: bool = False,
                       print_fn: Callable[[str], None] = print) -> RunResult:
    """Train a reward model on ``config.data``'s preference pairs.

    Args:
        config: the run (``RewardModelConfig``).
        model: the backbone (a ``TransformerLM``) in memory instead of ``config.model``.
        tokenizer, template, overwrite, progress, print_fn: as ``plyx.rl.sft``.

    Returns:
        ``RunResult``: ``model_dir`` is the ``reward_model/`` directory, ``model`` the ``RewardModel``; metrics
        carry ``eval/accuracy_before`` / ``eval/accuracy`` when ``eval_data`` is set (also in ``eval.json``).
    """
    held_out: list[PairExample] = []

    def tokenize(tok: Any, tmpl: ChatTemplate | None) -> TokenizedData:
        nonlocal held_out
        options = dict(max_length=config.max_length, truncation=config.truncation, strict=config.strict)
        if config.eval_data:
            held_out = tokenize_pairs(config.eval_data, tok, tmpl, **options).examples
        return tokenize_pairs(config.data, tok, tmpl, **options)

    backbone, tokenizer, template, data, out_dir = _begin(config, model, tokenizer, template, tokenize, overwrite,
                                                          print_fn)
    torch.manual_seed(config.seed)
    rm = RewardModel(backbone)
    pad = int(tokenizer.eos_id)
    device = next(rm.parameters()).device
    pairs: list[PairExample] = data.examples
    max_len = int(backbone.config.max_seq_len)
    before = pair_accuracy(rm, held_out, pad) if held_out else None

    def step_fn(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        b = len(idx)
        batch = _collate([pairs[i] for i in idx], pad, max_len)
        rewards = rm(batch.ids.to(device), batch.lengths.to(device))  # (2B,)
        rc, rr = rewards[:b], rewards[b:]
        loss = bradley_terry_loss(rc, rr, batch.margins.to(device) + config.margin,
                                  config.center_rewards_coefficient)
        with torch.no_grad():
            return loss, {"loss": float(loss.detach()), "accuracy": float((rc > rr).float().mean()),
                          "rewards/chosen": float(rc.mean()), "rewards/rejected": float(rr.mean()),
                          "rewards/margins": float((rc - rr).mean())}

    step, history, stopped = _fit(rm, config, len(pairs), step_fn, out_dir, progress=progress, print_fn=print_fn)
    rm.eval()
    card = {"method": "reward_model", "steps": step, "config": config.to_dict(), "data": data.report.to_dict(),
            "stopped": stopped}
    metrics = dict(history[-1]) if history else {}
    if held_out:
        after = pair_accuracy(rm, held_out, pad)
        metrics.update({"eval/accuracy_before": before, "eval/accuracy": after})
        card["eval"] = {"pairs": len(held_out), "accuracy_before": before, "accuracy": after}
        _atomic_json(out_dir / "eval.json", card["eval"])
        print_fn(f"held-out pair accuracy: {before:.3f} -> {after:.3f} ({len(held_out)} pairs)")
    model_dir = _save(rm, config, tokenizer, template, out_dir, card)
    print_fn(f"plyx rl rm: {step} steps -> {model_dir}")
    return RunResult(out_dir, model_dir, None, metrics, history, step, data.report.to_dict(), stopped, rm)
