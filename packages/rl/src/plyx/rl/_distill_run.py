"""``plyx rl distill``: knowledge distillation of a student from a teacher, off-policy and on-policy.

Off-policy, the student is taught on the dataset's completions (the SFT data formats: ``messages``,
``prompt``/``completion``, ``text``); on-policy, on its own samples of the dataset's prompts, drawn with
``plyx.serve.generate`` (GKD, Agarwal et al. 2024: the student learns where it actually goes). Each step is
on-policy with probability ``on_policy_fraction`` (GKD's lambda; 0: off-policy only, 1: on-policy only).

At every position of a completion, the teacher's next-token distribution is the target: both models run
on the same ids, their final hidden states go to ``distill_loss`` with the two LM heads, chunked over
tokens (``plyx.rl._distill``), so the ``[tokens, V]`` logits of neither model exist at once. The teacher
is a (larger) plyx checkpoint or a Hugging Face checkpoint directory (``plyx.model.load_checkpoint`` reads
both); it must share the student's vocabulary. The mean per-token divergence on ``eval_data`` is measured
before the first step and after the last (``eval.json``).

The loop, its optimiser, schedule, progress, Ctrl-C handling and the saved checkpoint are ``plyx rl sft``'s
(``plyx.rl._run``).
"""

from __future__ import annotations

import difflib
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import attrs
import msgspec
import torch
from plyx.rl._chat import ChatTemplate
from plyx.rl._config import RunConfig
from plyx.rl._data import DataError, SFTExample, TokenizedData, collate_sft, completion_rows, tokenize_sft
from plyx.rl._distill import DISTILL_LOSSES, check_distill_options, distill_loss
from plyx.rl._run import END_OF_TURN, RunResult, _atomic_json, _begin, _device, _finish, _fit, _load_model
from plyx.specs import Batch, ConfigError
from torch import nn

__all__ = ["DistillConfig", "distill", "distill_eval"]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(ge=1)]


class DistillConfig(RunConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``plyx rl distill``: a student (``model``) taught by a ``teacher``."""

    SCHEMA = "rl.distill"
    VERSION = 1

    teacher: str = ""
    """The teacher: a plyx or Hugging Face checkpoint directory with the student's vocabulary."""
    loss: str = "forward_kl"
    """forward_kl (KL(teacher || student)) | reverse_kl (KL(student || teacher)) | jsd (generalised, beta) | topk."""
    beta: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    """(jsd) interpolation: 0 is forward KL, 1 reverse KL (TRL's GKD conventions)."""
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Softmax temperature of both models in the loss."""
    top_k: NonNeg = 0
    """(topk) teacher tokens kept per position (its probabilities renormalised over them)."""
    on_policy_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Share of steps taught on the student's own samples (GKD's lambda): 0 off-policy, 1 on-policy."""
    max_new_tokens: Pos = 64
    """(on-policy) most tokens sampled per completion."""
    sample_temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """(on-policy) the student's sampling temperature (0: greedy)."""
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    """The teacher's parameter dtype (bfloat16 halves its memory; the loss still runs its softmax in float32)."""
    chunk_size: NonNeg = 0
    """Tokens per loss chunk (0: about 8M logits per chunk)."""
    eval_data: str = ""
    """Held-out JSONL (same formats as data): the mean per-token divergence before and after (empty: none)."""
    out_dir: str = "runs/distill"
    """Where model/, metrics.jsonl, eval.json and data_report.json go."""

    def check(self) -> None:
        if self.loss not in DISTILL_LOSSES:
            close = difflib.get_close_matches(self.loss, DISTILL_LOSSES, n=1)
            raise ConfigError("$.loss", "unknown distillation loss", value=self.loss,
                              fix=(f"did you mean {close[0]!r}? " if close else "") +
                              f"choose one of {', '.join(DISTILL_LOSSES)}")
        if self.loss == "topk" and self.top_k < 1:
            raise ConfigError("$.top_k", "loss 'topk' needs top_k >= 1", value=self.top_k,
                              fix="set top_k, e.g. top_k = 64")


def _prompts(examples: Sequence[SFTExample]) -> list[tuple[int, ...]]:
    """Each example's prompt for on-policy sampling: its tokens before the first loss token (at least one)."""
    out = []
    for ex in examples:
        first = next((i for i, m in enumerate(ex.loss_mask) if m), len(ex.ids))
        out.append(ex.ids[: max(first, 1)])
    return out


def load_teacher(path: str, device: torch.device, dtype: str = "float32") -> nn.Module:
    """The teacher from a plyx or Hugging Face checkpoint directory, frozen, in eval mode."""
    from plyx.model import load_checkpoint

    if not path:
        raise DataError("no teacher: set `teacher` to a plyx or Hugging Face checkpoint directory")
    if not Path(path).exists():
        raise FileNotFoundError(f"teacher checkpoint {path!r} not found; set `teacher` to a checkpoint directory")
    return load_checkpoint(path, device=device, dtype=dtype)


def _check_vocab(student: nn.Module, teacher: nn.Module) -> None:
    vs, vt = int(student.config.vocab_size), int(teacher.config.vocab_size)
    if vs != vt:
        raise DataError(
            f"vocabulary mismatch: the student has {vs} tokens and the teacher {vt}; distillation compares "
            "next-token distributions token by token, so both must use one tokenizer and vocabulary size "
            "(pick a teacher of the student's family, or build the student with the teacher's tokenizer and "
            f"vocab_size = {vt})")


def _hidden(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch.input_ids, attention_mask=batch.attention_mask, return_hidden=True)  # (B, T, D)


def _pair_loss(student: nn.Module, teacher: nn.Module, batch: Batch, config: DistillConfig) -> torch.Tensor:
    """The step's loss on one batch: student and teacher on the same ids, divergence where targets exist."""
    from plyx.rl._logprobs import _unwrap

    hs = _hidden(student, batch)  # (B, T, D_s)
    with torch.no_grad():
        ht = _hidden(teacher, batch)  # (B, T, D_t)
    ws, wt = _unwrap(student).lm_head_weight, teacher.lm_head_weight
    mask = batch.targets != -100  # the positions that predict a completion token
    return distill_loss(hs.to(ws.dtype), ws, ht.to(wt.dtype), wt, loss=config.loss, beta=config.beta,
                        temperature=config.temperature, top_k=config.top_k, mask=mask,
                        chunk_size=config.chunk_size or None)


@torch.no_grad()
def distill_eval(student: nn.Module, teacher: nn.Module, examples: Sequence[SFTExample], config: DistillConfig,
                 pad_id: int, batch_size: int = 16) -> float:
    """Mean per-token divergence (``config.loss``) of the student from the teacher on ``examples``' targets."""
    device = next(student.parameters()).device
    was = student.training
    student.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(examples), batch_size):
            batch = collate_sft(list(examples[i: i + batch_size]), pad_id).to(device)
            n = int((batch.targets != -100).sum())
            total += float(_pair_loss(student, teacher, batch, config)) * n
            count += n
    finally:
        student.train(was)
    return total / max(count, 1)


def _stop_ids(tokenizer: Any, template: ChatTemplate | None) -> list[int]:
    stops = [int(tokenizer.eos_id)]
    if template is not None:
        vocab = tokenizer.inner.get_vocab(with_added_tokens=True)
        stops += [int(vocab[t]) for t in END_OF_TURN if t in vocab and t in template.source]
    return sorted(set(stops))


def distill(config: DistillConfig, *, model: nn.Module | None = None, teacher: nn.Module | None = None,
            tokenizer: Any = None, template: ChatTemplate | None = None, overwrite: bool = False,
            progress: bool = False, print_fn: Callable[[str], None] = print) -> RunResult:
    """Distil ``config.teacher`` into ``config.model``.

    Args:
        config: the run (``DistillConfig``).
        model: the student in memory instead of ``config.model``.
        teacher: the teacher in memory instead of ``config.teacher``.
        tokenizer, template, overwrite, progress, print_fn: as ``plyx.rl.sft``.

    Returns:
        ``RunResult``; its metrics carry ``eval/divergence_before`` and ``eval/divergence_after`` when
        ``eval_data`` is set (also in ``out_dir/eval.json``).
    """
    check_distill_options(config.loss, beta=config.beta, temperature=config.temperature, top_k=config.top_k)
    device = _device(config.device)
    if teacher is None:
        teacher = load_teacher(config.teacher, device, config.teacher_dtype)
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if config.loss == "topk" and config.top_k > int(teacher.config.vocab_size):
        raise DataError(f"top_k {config.top_k} exceeds the vocabulary size {teacher.config.vocab_size}; use "
                        f"top_k <= {teacher.config.vocab_size} (or loss = 'forward_kl' for the whole vocabulary)")
    held_out: list[SFTExample] = []

    def tokenize(tok: Any, tmpl: ChatTemplate | None) -> TokenizedData:
        nonlocal held_out
        options = dict(max_length=config.max_length, truncation=config.truncation, strict=config.strict)
        if config.eval_data:
            held_out = tokenize_sft(config.eval_data, tok, tmpl, **options).examples
        return tokenize_sft(config.data, tok, tmpl, **options)

    model = _load_model(config, model, device)
    _check_vocab(model, teacher)  # before _begin creates out_dir
    student, tokenizer, template, data, out_dir = _begin(config, model, tokenizer, template, tokenize, overwrite,
                                                         print_fn)
    pad = int(tokenizer.eos_id)
    examples: list[SFTExample] = data.examples
    prompt_ids = _prompts(examples)
    stops = _stop_ids(tokenizer, template)
    coin = random.Random(config.seed + 7)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 11)

    before = distill_eval(student, teacher, held_out, config, pad) if held_out else None
    if before is not None:
        print_fn(f"held-out {config.loss} before: {before:.4f}")

    def sample(prompts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        from plyx.serve import SamplingParams, generate

        room = int(student.config.max_seq_len) - max(len(p) for p in prompts)
        params = SamplingParams(max_new_tokens=max(1, min(config.max_new_tokens, room)),
                                temperature=config.sample_temperature)
        was = student.training
        student.eval()
        try:
            with torch.no_grad():
                outs = generate(student, [list(p) for p in prompts], params, eos_token_id=stops, generator=gen)
        finally:
            student.train(was)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    def step_fn(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        prompts = [prompt_ids[i] for i in idx]
        on_policy = coin.random() < config.on_policy_fraction
        t = time.perf_counter()
        if on_policy:  # the student's samples after each prompt; every sampled token is taught
            batch = completion_rows(prompts, sample(prompts), pad).to(student_device)
        else:  # the dataset's completions, where the example's loss mask says (assistant turns only)
            batch = collate_sft([examples[i] for i in idx], pad).to(student_device)
        generate_s = time.perf_counter() - t if on_policy else 0.0
        loss = _pair_loss(student, teacher, batch, config)
        # metrics are averaged over a step's micro-batches; generate_s is the sampling time per micro-batch
        return loss, {"loss": float(loss.detach()), "on_policy": float(on_policy),
                      "completion_tokens": float((batch.targets != -100).sum()) / len(idx),
                      "generate_s": generate_s}

    student_device = next(student.parameters()).device
    step, history, stopped = _fit(student, config, len(examples), step_fn, out_dir, progress=progress,
                                  print_fn=print_fn)
    result = _finish(student, config, tokenizer, template, out_dir, data, step, history, stopped, "distill", print_fn)
    if before is None:
        return result
    after = distill_eval(student, teacher, held_out, config, pad)
    print_fn(f"held-out {config.loss}: {before:.4f} -> {after:.4f}")
    report = {"loss": config.loss, "examples": len(held_out), "divergence_before": before,
              "divergence_after": after}
    _atomic_json(out_dir / "eval.json", report)
    metrics = {**result.metrics, "eval/divergence_before": before, "eval/divergence_after": after}
    return attrs.evolve(result, metrics=metrics)
