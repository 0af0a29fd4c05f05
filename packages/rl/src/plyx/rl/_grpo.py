"""``grpo``: online group relative policy optimisation, sampling with plyx-serve's engine in-process.

Every step:

1. **sample**: ``batch_size`` prompts from a seeded sampler, G = ``num_generations`` completions each, with
   ``plyx.serve.engine.Engine`` (continuous batching, paged KV; ``SamplingParams(n=G)`` prefills each prompt
   once and forks its cache for the G completions). Each request carries its own seed, derived from the run's
   seed, the step and the slot, so what is sampled does not depend on the engine's history (resume is exact).
2. **score** with the reward functions (``plyx_reward_functions`` plugins); a function that raises scores the
   failing samples None (counted; ``strict`` stops the run). Advantages are normalised per group.
3. **skip** groups whose rewards are all equal (zero advantage: no policy gradient), counted; with dynamic
   sampling (DAPO) more prompts are sampled, up to ``max_sampling_rounds`` rounds, to fill the batch.
4. **train**: ``num_iterations`` (mu) clipped policy-gradient updates on the kept groups (``grpo_loss``), the
   prompt computed once per group in the log-prob pass (``share_prompt``); an update whose loss is not finite
   is skipped and named, and ``max_nan_steps`` of them in a row stop the run.
5. **sync**: the policy's weights are copied into the engine's model in place (``sync_weights``, timed).

The engine holds its own copy of the model (bf16 on CUDA by default) in eval mode; the policy trains in
float32. ``out_dir/state`` holds a resumable checkpoint every ``save_every`` steps (and at the end):
``resume=True`` (``--resume``) continues from it bitwise-exactly on the same machine.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from plyx.rl._chat import ChatTemplate
from plyx.rl._data import DataError, DataReport, TokenizedData, _check_messages, _Encoder, read_jsonl
from plyx.rl._group_logps import groups_token_logps
from plyx.rl._grpo_config import GRPOConfig, effective_grpo
from plyx.rl._grpo_losses import group_advantages, grpo_loss
from plyx.rl._grpo_state import PromptSampler, latest_state, load_state, save_state
from plyx.rl._rewards import build_rewards, score_completions
from plyx.rl._run import (
    END_OF_TURN,
    RunResult,
    _atomic_json,
    _catch_signals,
    _device,
    _load_model,
    _optimizer,
    _prepare_out_dir,
    _save,
    load_tokenizer_and_template,
)
from torch import nn

__all__ = ["PromptRecord", "grpo", "tokenize_prompts"]


@attrs.frozen
class PromptRecord:
    """One prompt of a GRPO run: its token ids, its text (what reward functions see) and its other fields."""

    ids: tuple[int, ...]
    text: str
    columns: dict[str, Any] = attrs.field(eq=False)
    line: int = 0


def tokenize_prompts(path: str, tokenizer: Any, template: ChatTemplate | None, *, max_prompt_length: int,
                     truncation: str = "skip", strict: bool = False) -> TokenizedData:
    """``{"prompt": str | messages, ...other fields}`` records: the prompt rendered (messages get the chat
    template's generation prompt) and tokenized; the other fields become the reward functions' columns.

    Prompts longer than ``max_prompt_length`` (``max_length - max_new_tokens``) follow ``truncation``.
    """
    enc = _Encoder(tokenizer, template)
    report = DataReport(str(path))
    out: list[PromptRecord] = []
    for number, record in read_jsonl(path):
        report.records += 1
        where = f"{path}:{number}"
        if "prompt" not in record:
            raise DataError(f"{where}: missing field 'prompt' (has {', '.join(sorted(record)) or 'none'})")
        prompt = record["prompt"]
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list):
            text = enc.need_template(where).render(_check_messages(prompt, where, "prompt"),
                                                   add_generation_prompt=True)
        else:
            raise DataError(f"{where}: field 'prompt' must be a string or a list of messages, got "
                            f"{type(prompt).__name__}")
        ids = enc.encode(text)
        if not ids:
            report.skip(number, "empty_prompt")
            if strict:
                raise DataError(f"{where}: the prompt encodes to no token; fix the record or drop `--strict`")
            continue
        if len(ids) > max_prompt_length:
            if truncation == "error" or strict:
                raise DataError(f"{where}: the prompt has {len(ids)} tokens, more than max_length - max_new_tokens "
                                f"= {max_prompt_length}; raise max_length or set truncation = 'skip' or 'truncate'")
            if truncation == "skip":
                report.skip(number, "too_long")
                continue
            report.truncated += 1
            ids = ids[-max_prompt_length:]  # keep the end: what the completion answers
        columns = {k: v for k, v in record.items() if k != "prompt"}
        out.append(PromptRecord(tuple(ids), text, columns, number))
    report.kept = len(out)
    if not out:
        raise DataError(f"{report.summary()}: no usable prompt; see the skip reasons")
    # every record must carry the same fields: reward functions get one list per field
    keys = set(out[0].columns)
    for r in out:
        if set(r.columns) != keys:
            raise DataError(f"{path}:{r.line}: fields {sorted(r.columns)} differ from the first record's "
                            f"{sorted(keys)}; give every record the same fields (null where unknown)")
    return TokenizedData(out, report)


def _stop_ids(tokenizer: Any, template: ChatTemplate | None) -> list[int]:
    stops = {int(tokenizer.eos_id)}
    if template is not None:
        vocab = tokenizer.inner.get_vocab(with_added_tokens=True)
        stops.update(int(vocab[t]) for t in END_OF_TURN if t in vocab and t in template.source)
    return sorted(stops)


def _progress(enabled: bool) -> Any:
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]plyx rl grpo"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"))


def _request_seed(seed: int, step: int, rnd: int, slot: int, group: int) -> int:
    """The seed of one request: completion i of it draws with ``seed + i`` (the engine's rule), so slots are G apart."""
    return ((seed * 1_000_003 + step) * 101 + rnd) % (1 << 32) * (1 << 20) + slot * group


@attrs.define
class _Samples:
    """The kept groups of one step (row = completion, G consecutive rows per group)."""

    prompts: list[tuple[int, ...]] = attrs.field(factory=list)  # one per group
    completions: list[list[int]] = attrs.field(factory=list)
    advantages: list[float] = attrs.field(factory=list)


def grpo(config: GRPOConfig, *, model: nn.Module | None = None, tokenizer: Any = None,
         template: ChatTemplate | None = None, overwrite: bool = False, resume: bool = False, progress: bool = False,
         print_fn: Callable[[str], None] = print) -> RunResult:
    """Run GRPO (``config.loss_type``: grpo | dr_grpo | dapo) from ``config.model`` on ``config.data``'s prompts.

    Args:
        config: the run (``GRPOConfig``).
        model: a model in memory instead of ``config.model``.
        tokenizer: a ``plyx.train.Tokenizer`` instead of the model directory's.
        template: a ``ChatTemplate`` instead of the tokenizer directory's.
        overwrite: replace an existing out_dir's results.
        resume: continue from ``out_dir/state`` (policy, optimizer, scheduler, sampler, RNG, counters).
        progress: a progress bar (else a line per ``log_every`` steps).

    Returns:
        ``RunResult``: ``model_dir`` (a plyx checkpoint with the tokenizer), ``metrics`` (the last row),
        ``history``; ``data`` is the prompt file's report.

    Raises:
        DataError, LookupError, FileExistsError: bad data, an unknown reward or optimizer, a non-empty out_dir,
            all before anything is written.
        RewardError: a reward function raised in strict mode.
        FloatingPointError: ``max_nan_steps`` consecutive non-finite losses.
    """
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig, sync_weights
    from plyx.train import build_scheduler

    if config.adapter is not None:
        raise DataError("grpo trains every weight: adapters are not supported yet (remove the [adapter] table)")
    if not config.data:
        raise DataError("no prompts: set `data` to a JSONL file of {\"prompt\": ..., \"answer\": ...} records")
    eff = effective_grpo(config)
    G = config.num_generations
    torch.manual_seed(config.seed)
    if tokenizer is None:
        tokenizer, found, _ = load_tokenizer_and_template(config)
        template = template or found
    if config.max_new_tokens >= config.max_length:
        raise DataError(f"max_new_tokens ({config.max_new_tokens}) must be below max_length ({config.max_length}): "
                        "max_length bounds prompt + completion")
    data = tokenize_prompts(config.data, tokenizer, template, max_prompt_length=config.max_length - config.max_new_tokens,
                            truncation=config.truncation, strict=config.strict)
    records: list[PromptRecord] = data.examples
    print_fn(data.report.summary())
    rewards = build_rewards(config.rewards)
    labels = [label for label, _, _ in rewards]
    if config.accuracy_reward and config.accuracy_reward not in labels:
        raise DataError(f"accuracy_reward {config.accuracy_reward!r} is not one of the run's rewards "
                        f"({', '.join(labels)}); name one of them or set it to \"\"")
    device = _device(config.device)
    policy = _load_model(config, model, device)
    mcfg = policy.config
    if tokenizer.vocab_size > int(mcfg.vocab_size):
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
                        f"{mcfg.vocab_size}; use the model's own tokenizer")
    if config.max_length > int(mcfg.max_seq_len):
        raise DataError(f"max_length {config.max_length} exceeds the model's context ({mcfg.max_seq_len}); lower it")

    out_dir = Path(config.out_dir)
    state_root = out_dir / "state"
    if resume:
        if latest_state(state_root) is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {state_root}; run without --resume (set save_every "
                                    "to write checkpoints during a run)")
    else:
        _prepare_out_dir(out_dir, overwrite)
        shutil.rmtree(state_root, ignore_errors=True)
    _atomic_json(out_dir / "config.json", config.to_dict())
    _atomic_json(out_dir / "data_report.json", data.report.to_dict())

    # the sampling engine: its own copy of the weights (bf16 on CUDA), synced in place after each update
    engine_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        config.engine_dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    engine_model = copy.deepcopy(policy).to(dtype=engine_dtype).eval().requires_grad_(False)
    stops = _stop_ids(tokenizer, template)
    engine = Engine(engine_model, eos_token_id=stops, seed=config.seed,
                    config=EngineConfig(block_size=config.engine_block_size, max_model_len=config.max_length,
                                        max_batch_size=config.engine_max_batch_size,
                                        max_batch_tokens=max(2048, config.engine_max_batch_size)))
    reference = None
    if config.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = _optimizer(policy, config)
    scheduler = build_scheduler(optimizer, config.schedule, config.steps * config.num_iterations)
    sampler = PromptSampler(len(records), config.seed)
    pad = int(tokenizer.eos_id)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    counters: dict[str, Any] = {"all_equal_groups": 0, "dropped_groups": 0, "skipped_steps": 0, "nan_updates": 0,
                                "nan_in_a_row": 0, "reward_errors": {}, "reward_skipped": {}, "sampled_groups": 0}
    start = 0
    metrics_path = out_dir / "metrics.jsonl"
    if resume:
        ckpt = latest_state(state_root)
        assert ckpt is not None
        start, counters = load_state(ckpt, policy, optimizer, scheduler, sampler)
        sync_weights(engine, policy)
        # rows the killed run logged after its last checkpoint are dropped: the resumed run logs them again
        kept = []
        if metrics_path.exists():
            kept = [ln for ln in metrics_path.read_text(encoding="utf-8").splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= start]
        tmp = metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        tmp.replace(metrics_path)
        print_fn(f"resumed from {ckpt} at step {start}")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if config.precision == "bf16-autocast"
                else contextlib.nullcontext())
    history: list[dict[str, float]] = []
    step = start
    totals = {"gen_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
    policy.train()

    def sample_round(step: int, rnd: int, k: int) -> tuple[list[int], list[Any]]:
        idx = sampler.take(k)
        sp = [SamplingParams(n=G, temperature=config.temperature, top_p=config.top_p,
                             max_new_tokens=config.max_new_tokens, seed=_request_seed(config.seed, step, rnd, j, G))
              for j in range(k)]
        outs = engine.generate([list(records[i].ids) for i in idx], sp)
        return idx, outs

    with _catch_signals() as sig, _progress(progress) as bar, metrics_path.open("a", encoding="utf-8") as mfile:
        task = bar.add_task("grpo", total=config.steps, completed=start, info="") if bar is not None else None
        while step < config.steps and sig["stopped"] is None:
            # -- 1-3. sample, score, keep the groups that carry a signal ------------------------------
            t0 = time.perf_counter()
            if engine.prefix is not None:
                engine.prefix.clear()  # every step starts from the same engine state (exact resume)
            kept = _Samples()
            per_fn: dict[str, list[float]] = {label: [] for label in labels}
            totals_r: list[float] = []
            lengths: list[int] = []
            truncated = 0
            rounds = config.max_sampling_rounds if eff["dynamic_sampling"] else 1
            for rnd in range(rounds):
                need = config.batch_size - len(kept.prompts)
                if need <= 0:
                    break
                idx, outs = sample_round(step, rnd, need)
                prompts_txt, comps_txt, comp_ids = [], [], []
                columns: dict[str, list[Any]] = {k: [] for k in records[idx[0]].columns}
                for i, out in zip(idx, outs):
                    for c in out.outputs:
                        ids = list(c.token_ids)
                        body = ids[:-1] if ids and ids[-1] in stops else ids
                        comps_txt.append(tokenizer.decode(body))
                        comp_ids.append(ids)
                        prompts_txt.append(records[i].text)
                        for k2 in columns:
                            columns[k2].append(records[i].columns[k2])
                        lengths.append(len(ids))
                        truncated += c.finish_reason == "length"
                scores = score_completions(rewards, prompts_txt, comps_txt, {**columns, "completion_ids": comp_ids},
                                           strict=config.strict)
                for label in labels:
                    per_fn[label] += scores.per_function[label]
                    counters["reward_errors"][label] = counters["reward_errors"].get(label, 0) + scores.errors.get(label, 0)
                    counters["reward_skipped"][label] = (counters["reward_skipped"].get(label, 0)
                                                         + scores.skipped.get(label, 0))
                if scores.first_error:
                    print_fn(f"step {step + 1}: reward failed on some samples (scored None): {scores.first_error}")
                totals_r += scores.total
                reward_t = torch.tensor(scores.total, dtype=torch.float64)
                adv, std = group_advantages(reward_t, G, scale=eff["scale_rewards"])
                counters["sampled_groups"] += len(idx)
                for gi in range(len(idx)):
                    if not std[gi] > 0:  # all equal (or fewer than two scored): zero advantage, skipped
                        counters["all_equal_groups"] += 1
                        if eff["dynamic_sampling"]:
                            counters["dropped_groups"] += 1
                        continue
                    if len(kept.prompts) >= config.batch_size:
                        continue
                    kept.prompts.append(records[idx[gi]].ids)
                    kept.completions += comp_ids[gi * G:(gi + 1) * G]
                    kept.advantages += adv[gi * G:(gi + 1) * G].tolist()
            gen_s = time.perf_counter() - t0

            # -- 4. mu clipped policy-gradient updates on the kept groups ----------------------------
            t1 = time.perf_counter()
            row: dict[str, Any] = {}
            losses, kls, clips, clip_lo, clip_hi, norms = [], [], [], [], [], []
            if not kept.prompts:
                counters["skipped_steps"] += 1
                print_fn(f"step {step + 1}: every group's rewards were equal: no update (counted as skipped)")
            else:
                n_seq = len(kept.completions)
                n_tok = sum(len(c) for c in kept.completions)
                mb = config.micro_batch_groups
                chunks = [range(s, min(s + mb, len(kept.prompts))) for s in range(0, len(kept.prompts), mb)]
                advantages = torch.tensor(kept.advantages, dtype=torch.float32, device=device)

                def logps_of(m: nn.Module, ch: range, kept: _Samples = kept) -> tuple[torch.Tensor, torch.Tensor]:
                    with autocast:
                        return groups_token_logps(m, [kept.prompts[g] for g in ch],
                                                  kept.completions[ch.start * G:ch.stop * G], G, pad=pad,
                                                  share_prompt=config.share_prompt)

                olds: list[torch.Tensor | None] = [None] * len(chunks)
                refs: list[torch.Tensor | None] = [None] * len(chunks)
                with torch.no_grad():
                    for ci, ch in enumerate(chunks):
                        if config.num_iterations > 1:  # pi_old: the policy that sampled, before the first update
                            olds[ci] = logps_of(policy, ch)[0]
                        if reference is not None:
                            refs[ci] = logps_of(reference, ch)[0]
                for it in range(config.num_iterations):
                    optimizer.zero_grad(set_to_none=True)
                    finite = True
                    loss_sum, kl_sum, clip_sum, lo_sum, hi_sum = 0.0, 0.0, 0.0, 0.0, 0.0
                    for ci, ch in enumerate(chunks):
                        logps, mask = logps_of(policy, ch)
                        rows_ = slice(ch.start * G, ch.stop * G)
                        out = grpo_loss(logps, advantages[rows_], mask, old_logps=olds[ci], ref_logps=refs[ci],
                                        loss_type=config.loss_type, beta=config.beta, epsilon_low=config.epsilon,
                                        epsilon_high=eff["epsilon_high"], max_completion_length=config.max_new_tokens,
                                        num_sequences=n_seq, num_tokens=n_tok)
                        if not torch.isfinite(out.loss):
                            finite = False
                            break
                        out.loss.backward()
                        share = out.tokens / max(n_tok, 1)
                        loss_sum += float(out.loss.detach())
                        kl_sum += out.kl * share
                        clip_sum += out.clip_fraction * share
                        lo_sum += out.clip_low * share
                        hi_sum += out.clip_high * share
                    if not finite:
                        optimizer.zero_grad(set_to_none=True)
                        counters["nan_updates"] += 1
                        counters["nan_in_a_row"] += 1
                        print_fn(f"step {step + 1}, update {it + 1}: the loss is not finite ({float(out.loss.detach())}): "
                                 f"update skipped ({counters['nan_in_a_row']} in a row)")
                        if counters["nan_in_a_row"] >= config.max_nan_steps:
                            raise FloatingPointError(
                                f"{counters['nan_in_a_row']} consecutive updates had a non-finite loss (the last at "
                                f"step {step + 1}, update {it + 1}); max_nan_steps = {config.max_nan_steps}. Lower "
                                "the learning rate, check the rewards, or raise max_nan_steps")
                        continue
                    counters["nan_in_a_row"] = 0
                    clip = config.optimizer.grad_clip
                    norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)))
                    optimizer.step()
                    scheduler.step()
                    losses.append(loss_sum)
                    kls.append(kl_sum if reference is not None else math.nan)  # no reference (beta 0): no KL
                    clips.append(clip_sum)
                    clip_lo.append(lo_sum)
                    clip_hi.append(hi_sum)
                optimizer.zero_grad(set_to_none=True)
            train_s = time.perf_counter() - t1

            # -- 5. the engine takes the new weights ---------------------------------------------------
            sync_s = sync_weights(engine, policy) if losses else 0.0
            step += 1
            for k, v in (("gen_s", gen_s), ("train_s", train_s), ("sync_s", sync_s)):
                totals[k] += v

            # -- metrics -------------------------------------------------------------------------------
            def stats(values: Sequence[float]) -> tuple[float, float]:
                vals = [v for v in values if not math.isnan(v)]
                if not vals:
                    return math.nan, math.nan
                m = sum(vals) / len(vals)
                return m, (sum((v - m) ** 2 for v in vals) / max(len(vals) - 1, 1)) ** 0.5

            row["step"] = step
            row["loss"] = losses[-1] if losses else math.nan
            row["reward"], row["reward_std"] = stats(totals_r)
            for label in labels:
                row[f"rewards/{label}/mean"], row[f"rewards/{label}/std"] = stats(per_fn[label])
            if config.accuracy_reward:
                row["accuracy"] = stats(per_fn[config.accuracy_reward])[0]
            row["kl"] = kls[-1] if kls else math.nan
            row["clip_fraction"] = clips[-1] if clips else math.nan
            row["clip_ratio/low"] = clip_lo[-1] if clip_lo else math.nan
            row["clip_ratio/high"] = clip_hi[-1] if clip_hi else math.nan
            row["completion_length"] = sum(lengths) / max(len(lengths), 1)
            row["completions_truncated"] = truncated / max(len(lengths), 1)
            row["groups_trained"] = len(kept.prompts)
            row["all_equal_groups"] = counters["all_equal_groups"]
            row["dropped_groups"] = counters["dropped_groups"]
            row["skipped_steps"] = counters["skipped_steps"]
            row["nan_updates"] = counters["nan_updates"]
            row["reward_errors"] = sum(counters["reward_errors"].values())
            row["grad_norm"] = norms[-1] if norms else math.nan
            row["lr"] = scheduler.get_last_lr()[0]
            wall = gen_s + train_s + sync_s
            row["gen_s"], row["train_s"], row["sync_s"] = gen_s, train_s, sync_s
            row["gen_share"] = gen_s / wall if wall else math.nan
            row["train_share"] = train_s / wall if wall else math.nan
            row["samples_per_s"] = len(lengths) / gen_s if gen_s else math.nan
            row["tokens_per_s"] = sum(lengths) / gen_s if gen_s else math.nan
            history.append(row)
            mfile.write(json.dumps(row) + "\n")
            mfile.flush()
            if step % config.log_every == 0 or step == config.steps:
                line = (f"step {step}/{config.steps} reward {row['reward']:.3f}"
                        + (f" acc {row['accuracy']:.3f}" if "accuracy" in row else "")
                        + (f" kl {row['kl']:.4f}" if not math.isnan(row["kl"]) else "")  # beta 0: no reference
                        + f" clip {row['clip_fraction']:.3f} len {row['completion_length']:.1f}"
                        f" gen {row['gen_share']:.0%} train {row['train_share']:.0%} sync {sync_s * 1e3:.1f} ms")
                if bar is None:
                    print_fn(line)
            if bar is not None:
                bar.update(task, advance=1, info=f"reward {row['reward']:.3f} gen {row['gen_share']:.0%}")
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                save_state(state_root, step, policy, optimizer, scheduler, sampler, counters)

    save_state(state_root, step, policy, optimizer, scheduler, sampler, counters)
    card = {"name": "plyx-rl-grpo", "method": "grpo", "steps": step, "config": config.to_dict(),
            "data": data.report.to_dict(), "stopped": sig["stopped"], "counters": counters}
    policy.eval()
    model_dir, _ = _save(policy, config, tokenizer, template, out_dir, card)
    wall = sum(totals.values())
    print_fn(f"plyx rl grpo: {step} steps -> {model_dir}; generation {totals['gen_s'] / max(wall, 1e-9):.0%}, "
             f"training {totals['train_s'] / max(wall, 1e-9):.0%}, weight sync {totals['sync_s']:.2f} s in all")
    metrics = history[-1] if history else {}
    return RunResult(out_dir, model_dir, None, metrics, history, step, data.report.to_dict(), sig["stopped"], policy)
