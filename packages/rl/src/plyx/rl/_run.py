"""The post-training loops: ``sft`` and ``preference`` (DPO family, ORPO, SimPO, KTO).

Both share one loop built from plyx-train's public pieces: the ``plyx_optimizers`` plugin factories
(AdamW by default) over plyx-train's ``param_groups`` (or LoRA+ groups), ``build_scheduler``, gradient
clipping and accumulation, bf16 autocast, a rich progress bar, and ``plyx.model.save_checkpoint`` for
the result. What differs is the step's loss, a callable of the micro-batch's examples.

Order of work, so that nothing half-written lands in ``out_dir``: load the model, the tokenizer and the
template, tokenize and validate every record (errors and skip counts come here), then create
``out_dir``; checkpoints and adapters are written atomically (temporary directory + rename), and
Ctrl-C finishes the current step and saves what was trained so far.

The reference of DPO and KTO is the starting model. Its log-probs of every example are computed once,
before the first step, and cached (with adapters, under ``disable_adapters``: the base, no second model
in memory); each step then runs the policy only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from plyx.rl._chat import ChatTemplate, ChatTemplateError, load_chat_template, strip_generation_tags
from plyx.rl._config import PreferenceConfig, RunConfig, SFTConfig, default_beta
from plyx.rl._data import (
    DataError,
    KTOExample,
    PairExample,
    SFTExample,
    TokenizedData,
    collate_packed,
    collate_sft,
    completion_rows,
    pack_sft,
    tokenize_kto,
    tokenize_pairs,
    tokenize_sft,
)
from plyx.rl._logprobs import sequence_logps, token_logps
from plyx.rl._losses import dpo_loss, kto_loss, orpo_loss, preference_metrics, simpo_loss
from plyx.specs import Batch, components
from torch import nn

__all__ = ["END_OF_TURN", "RunResult", "preference", "sft", "load_tokenizer_and_template"]

#: end-of-turn tokens of common chat templates; those a run's template uses become stop ids of the saved model
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")


@attrs.frozen
class RunResult:
    """What a run left behind.

    Attributes:
        out_dir: the run directory.
        model_dir: the trained (or adapter-merged) plyx checkpoint with its tokenizer, or None.
        adapter_dir: the PEFT adapter directory (adapter runs), or None.
        metrics: the last logged metrics.
        history: every logged metrics row.
        step: optimizer steps done.
        data: the data report (records, kept, skipped by reason, truncated).
        stopped: ``"SIGINT"`` / ``"SIGTERM"`` when interrupted, else None.
        model: the trained model in memory (adapters still attached for adapter runs).
    """

    out_dir: Path
    model_dir: Path | None
    adapter_dir: Path | None
    metrics: dict[str, float]
    history: list[dict[str, float]]
    step: int
    data: dict[str, Any]
    stopped: str | None
    model: Any = attrs.field(repr=False, eq=False)


# -- setup ------------------------------------------------------------------------------
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_tokenizer_and_template(config: RunConfig, *, need_template: bool = False
                                ) -> tuple[Any, ChatTemplate | None, Path]:
    """The run's tokenizer, chat template (None when there is none and none is needed) and tokenizer directory."""
    from plyx.train import load_tokenizer

    source = config.tokenizer or config.model
    if not source:
        raise DataError("no tokenizer: set `tokenizer` (a tokenizer.json) or `model` (a directory holding one)")
    tok_path = Path(source)
    tokenizer = load_tokenizer(tok_path)
    tok_dir = tokenizer.path.parent if tokenizer.path is not None else tok_path
    try:
        template = load_chat_template(tok_dir, config.chat_template)
    except ChatTemplateError:
        if need_template or config.chat_template:
            raise
        template = None
    return tokenizer, template, tok_dir


def _load_model(config: RunConfig, model: nn.Module | None, device: torch.device) -> nn.Module:
    if model is not None:
        return model.to(device)
    if not config.model:
        raise DataError("no model: set `model` to a plyx or Hugging Face checkpoint directory")
    from plyx.model import load_checkpoint

    return load_checkpoint(config.model, device=device, dtype="float32")


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"out_dir {str(out_dir)!r} is not empty; choose another out_dir or pass "
                                  "overwrite=True (`--overwrite`)")
        for child in ("model", "adapter", "metrics.jsonl", "data_report.json", "config.json"):
            target = out_dir / child
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _atomic_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _attach_adapter(model: nn.Module, config: RunConfig) -> None:
    from plyx.model.adapters import LoraConfig, add_adapter, mark_only_adapters_trainable

    a = config.adapter
    assert a is not None
    add_adapter(model, LoraConfig(r=a.r, alpha=a.alpha, dropout=a.dropout, target_modules=tuple(a.target_modules),
                                  variant=a.variant, lora_plus_ratio=a.lora_plus_ratio), name="default")
    mark_only_adapters_trainable(model, "default")


def _optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    from plyx.train import param_groups

    found = components("plyx_optimizers")
    name = config.optimizer.name
    if name not in found:
        raise LookupError(f"optimizer {name!r} not found. It is either misspelled or not installed "
                          f"(optimizer.name; available: {', '.join(sorted(found)) or 'none'})")
    if config.adapter is not None and config.adapter.lora_plus_ratio is not None:
        from plyx.model.adapters import lora_plus_param_groups

        groups = lora_plus_param_groups(model, config.optimizer.lr, weight_decay=config.optimizer.weight_decay)
    else:
        groups = param_groups(model, config.optimizer.weight_decay)
    return found[name].factory(groups, config.optimizer)


@contextlib.contextmanager
def _catch_signals() -> Iterator[dict[str, str | None]]:
    """Record SIGINT/SIGTERM instead of dying mid-step; the loop stops after the current step."""
    state: dict[str, str | None] = {"stopped": None}
    previous = {}

    def handler(signum: int, _frame: Any) -> None:
        state["stopped"] = signal.Signals(signum).name

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: no handlers, Ctrl-C behaves as usual
        previous.clear()
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]plyx rl"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"), transient=False)


def _batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Example indices, ``batch_size`` at a time, in a seeded order reshuffled every epoch."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        for i in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield order[i: i + batch_size]
        epoch += 1


StepFn = Callable[[list[int]], tuple[torch.Tensor, dict[str, float]]]


def _fit(model: nn.Module, config: RunConfig, n_examples: int, step_fn: StepFn, out_dir: Path, *,
         progress: bool, print_fn: Callable[[str], None]) -> tuple[int, list[dict[str, float]], str | None]:
    """The optimisation loop; returns (steps done, logged metrics rows, stop signal)."""
    from plyx.train import build_scheduler

    device = next(model.parameters()).device
    optimizer = _optimizer(model, config)
    scheduler = build_scheduler(optimizer, config.schedule, config.steps)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if config.precision == "bf16-autocast"
                else contextlib.nullcontext())
    batches = _batches(n_examples, config.batch_size, config.seed)
    history: list[dict[str, float]] = []
    metrics_file = (out_dir / "metrics.jsonl").open("a", encoding="utf-8")
    model.train()
    step = 0
    with _catch_signals() as state, _progress(progress, config.steps) as bar, metrics_file:
        task = bar.add_task("train", total=config.steps, info="") if bar is not None else None
        t0 = time.perf_counter()
        while step < config.steps and state["stopped"] is None:
            sums: dict[str, float] = {}
            for _ in range(config.grad_accum):
                with autocast:
                    loss, metrics = step_fn(next(batches))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss {float(loss)} at step {step + 1}; lower the learning "
                                             "rate or beta, or check the data")
                (loss / config.grad_accum).backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v / config.grad_accum
            clip = config.optimizer.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % config.log_every == 0 or step == config.steps:
                row = {"step": step, **sums, "grad_norm": float(norm), "lr": scheduler.get_last_lr()[0],
                       "s_per_step": (time.perf_counter() - t0) / step}
                history.append(row)
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                if bar is None:
                    print_fn(" ".join(f"{k}={v:.4g}" for k, v in row.items()))
            if bar is not None:
                bar.update(task, advance=1, info=f"loss {sums.get('loss', float('nan')):.4f}")
    return step, history, state["stopped"]


def _save(model: nn.Module, config: RunConfig, tokenizer: Any, template: ChatTemplate | None, out_dir: Path,
          card: dict[str, Any]) -> tuple[Path | None, Path | None]:
    """Write ``adapter/`` (PEFT) and/or ``model/`` (plyx checkpoint + tokenizer files), each atomically."""
    from plyx.model import save_checkpoint

    adapter_dir = model_dir = None
    to_save = model
    if config.adapter is not None:
        import copy

        from plyx.model.adapters import merge_and_unload, save_peft

        adapter_dir = out_dir / "adapter"
        tmp = out_dir / f".adapter.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_peft(model, tmp, "default", base_model_name_or_path=config.model or None)
        if adapter_dir.exists():
            shutil.rmtree(adapter_dir)
        os.replace(tmp, adapter_dir)
        if not config.adapter.merge:
            return None, adapter_dir
        to_save = merge_and_unload(copy.deepcopy(model))
    model_dir = out_dir / "model"
    save_checkpoint(to_save, model_dir, card_fields={"name": card.pop("name", "plyx-rl"), "training": card})
    # the tokenizer files beside the weights: plyx serve finds tokenizer.json and the chat template there
    tokenizer.save(model_dir / "tokenizer.json")
    if template is not None:
        _atomic_json(model_dir / "tokenizer_config.json", {
            "chat_template": strip_generation_tags(template.source), "eos_token": tokenizer.eos_token, "bos_token": template.bos_token or None,
            "tokenizer_class": "PreTrainedTokenizerFast"})
        # a chat model stops at its end-of-turn token too (Hugging Face's generation_config convention)
        vocab = tokenizer.inner.get_vocab(with_added_tokens=True)
        stops = [int(tokenizer.eos_id)] + [int(vocab[t]) for t in END_OF_TURN if t in vocab and t in template.source]
        _atomic_json(model_dir / "generation_config.json", {"eos_token_id": sorted(set(stops))})
    return model_dir, adapter_dir


def _finish(model: nn.Module, config: RunConfig, tokenizer: Any, template: ChatTemplate | None, out_dir: Path,
            data: TokenizedData, step: int, history: list[dict[str, float]], stopped: str | None, kind: str,
            print_fn: Callable[[str], None]) -> RunResult:
    card = {"name": f"plyx-rl-{kind}", "method": kind, "steps": step, "config": config.to_dict(),
            "data": data.report.to_dict(), "stopped": stopped}
    model.eval()
    model_dir, adapter_dir = _save(model, config, tokenizer, template, out_dir, card)
    metrics = history[-1] if history else {}
    print_fn(f"plyx rl {kind}: {step} steps -> {model_dir or adapter_dir}")
    return RunResult(out_dir, model_dir, adapter_dir, metrics, history, step, data.report.to_dict(), stopped, model)


def _begin(config: RunConfig, model: nn.Module | None, tokenizer: Any, template: ChatTemplate | None,
           tokenize: Callable[[Any, ChatTemplate | None], TokenizedData], overwrite: bool,
           print_fn: Callable[[str], None]) -> tuple[nn.Module, Any, ChatTemplate | None, TokenizedData, Path]:
    if not config.data:
        raise DataError("no training data: set `data` to a JSONL file")
    torch.manual_seed(config.seed)
    if tokenizer is None:
        tokenizer, found, _ = load_tokenizer_and_template(config)
        template = template or found
    elif template is None and config.chat_template:
        template = load_chat_template(Path(config.chat_template).parent, config.chat_template)
    data = tokenize(tokenizer, template)  # every record checked before anything is written
    print_fn(data.report.summary())
    device = _device(config.device)
    model = _load_model(config, model, device)
    vocab = int(model.config.vocab_size)
    if tokenizer.vocab_size > vocab:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {vocab}; use "
                        "the model's own tokenizer")
    if config.adapter is not None:
        _attach_adapter(model, config)
    out_dir = Path(config.out_dir)
    _prepare_out_dir(out_dir, overwrite)
    _atomic_json(out_dir / "config.json", config.to_dict())
    _atomic_json(out_dir / "data_report.json", data.report.to_dict())
    return model, tokenizer, template, data, out_dir


# -- SFT --------------------------------------------------------------------------------
def sft(config: SFTConfig, *, model: nn.Module | None = None, tokenizer: Any = None,
        template: ChatTemplate | None = None, overwrite: bool = False, progress: bool = False,
        print_fn: Callable[[str], None] = print) -> RunResult:
    """Supervised fine-tuning: next-token loss on the assistant's (or completion's, or text's) tokens.

    Args:
        config: the run (``SFTConfig``).
        model: a model in memory instead of ``config.model`` (e.g. freshly built for a demo).
        tokenizer: a ``plyx.train.Tokenizer`` instead of the model directory's.
        template: a ``ChatTemplate`` instead of the tokenizer directory's.
        overwrite: replace an existing out_dir's results.
        progress: show a progress bar (else a line per ``log_every`` steps).

    Returns:
        ``RunResult``; ``model_dir`` is a plain plyx checkpoint with ``tokenizer.json`` (and the template).
    """
    def tokenize(tok: Any, tmpl: ChatTemplate | None) -> TokenizedData:
        return tokenize_sft(config.data, tok, tmpl, max_length=config.max_length, truncation=config.truncation,
                            assistant_only_loss=config.assistant_only_loss, strict=config.strict)

    model, tokenizer, template, data, out_dir = _begin(config, model, tokenizer, template, tokenize, overwrite,
                                                       print_fn)
    device = next(model.parameters()).device
    pad = int(tokenizer.eos_id)
    examples: list[SFTExample] = data.examples
    if config.packing:
        units: list[Any] = pack_sft(examples, config.max_length, pad)
        collate: Callable[[list[Any]], Batch] = lambda rows: collate_packed(rows, pad)  # noqa: E731
    else:
        units = examples
        collate = lambda rows: collate_sft(rows, pad)  # noqa: E731

    def step_fn(indices: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = collate([units[i] for i in indices]).to(device)
        logps, mask = token_logps(model, batch)
        loss = -logps.sum() / mask.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum())}

    handle = None
    if config.neftune_alpha > 0:
        from plyx.model.adapters import neftune

        handle = neftune(model, config.neftune_alpha)
    try:
        with handle if hasattr(handle, "__enter__") else contextlib.nullcontext():
            step, history, stopped = _fit(model, config, len(units), step_fn, out_dir, progress=progress,
                                          print_fn=print_fn)
    finally:
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
    return _finish(model, config, tokenizer, template, out_dir, data, step, history, stopped, "sft", print_fn)


# -- preference -------------------------------------------------------------------------
@contextlib.contextmanager
def _reference(model: nn.Module, adapters: bool) -> Iterator[None]:
    """The reference: the base with adapters disabled, or the model as it is before the first step."""
    with torch.no_grad():
        if adapters:
            from plyx.model.adapters import disable_adapters

            with disable_adapters(model):
                yield
        else:
            yield


def _cached_logps(model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  pad: int, device: torch.device, chunk: int = 16) -> torch.Tensor:
    """Summed completion log-probs of every (prompt, completion), ``chunk`` rows per forward: ``[N]``."""
    was = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(prompts), chunk):
            batch = completion_rows(prompts[i: i + chunk], completions[i: i + chunk], pad).to(device)
            out.append(sequence_logps(model, batch)[0].detach())
    finally:
        model.train(was)
    return torch.cat(out)


def preference(config: PreferenceConfig, *, model: nn.Module | None = None, tokenizer: Any = None,
               template: ChatTemplate | None = None, overwrite: bool = False, progress: bool = False,
               print_fn: Callable[[str], None] = print) -> RunResult:
    """Preference optimisation with ``config.method``: dpo (sigmoid / ipo / hinge / robust / reference-free),
    orpo, simpo or kto. Arguments as ``sft``; data are pairs (``prompt``, ``chosen``, ``rejected``), or
    unpaired ``prompt``, ``completion``, ``label`` records for KTO.
    """
    method = config.method
    beta = default_beta(config)

    def tokenize(tok: Any, tmpl: ChatTemplate | None) -> TokenizedData:
        fn = tokenize_kto if method == "kto" else tokenize_pairs
        return fn(config.data, tok, tmpl, max_length=config.max_length, truncation=config.truncation,
                  strict=config.strict)

    model, tokenizer, template, data, out_dir = _begin(config, model, tokenizer, template, tokenize, overwrite,
                                                       print_fn)
    device = next(model.parameters()).device
    pad = int(tokenizer.eos_id)
    adapters = config.adapter is not None
    needs_ref = method == "kto" or (method == "dpo" and not config.reference_free)

    if method == "kto":
        examples_k: list[KTOExample] = data.examples
        n = len(examples_k)
        # KL estimate: completion i after the prompt of a fixed other example (a seeded derangement)
        g = torch.Generator().manual_seed(config.seed + 1)
        shift = int(torch.randint(1, n, (1,), generator=g)) if n > 1 else 0
        partner = [(i + shift) % n for i in range(n)]
        prompts = [e.prompt for e in examples_k]
        comps = [e.completion for e in examples_k]
        kl_prompts = [examples_k[partner[i]].prompt for i in range(n)]
        with _reference(model, adapters):
            ref = _cached_logps(model, prompts, comps, pad, device)
            ref_kl = _cached_logps(model, kl_prompts, comps, pad, device)
        labels = torch.tensor([e.desirable for e in examples_k], device=device)
        print_fn(f"reference log-probs cached for {n} examples (+{n} mismatched pairs for the KL estimate)")

        def step_fn(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
            batch = completion_rows([prompts[i] for i in idx], [comps[i] for i in idx], pad).to(device)
            pol = sequence_logps(model, batch)[0]
            with torch.no_grad():  # z is detached in the loss: its forward needs no graph (as in TRL)
                kl_batch = completion_rows([kl_prompts[i] for i in idx], [comps[i] for i in idx], pad).to(device)
                pol_kl = sequence_logps(model, kl_batch)[0]
            out = kto_loss(pol, ref[idx], labels[idx], pol_kl, ref_kl[idx], beta=beta,
                           desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight)
            sel = labels[idx]
            return out.loss, preference_metrics(out, pol[sel], pol[~sel])

        n_examples = n
    else:
        examples: list[PairExample] = data.examples
        n_examples = len(examples)
        prompts2 = [e.prompt for e in examples]
        chosen = [e.chosen for e in examples]
        rejected = [e.rejected for e in examples]
        if needs_ref:
            with _reference(model, adapters):
                ref_c = _cached_logps(model, prompts2, chosen, pad, device)
                ref_r = _cached_logps(model, prompts2, rejected, pad, device)
            print_fn(f"reference log-probs cached for {n_examples} pairs")

        def step_fn(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
            b = len(idx)
            batch = completion_rows([prompts2[i] for i in idx] * 2, [chosen[i] for i in idx] +
                                    [rejected[i] for i in idx], pad).to(device)  # rows: chosen..., rejected...
            logps, mask = token_logps(model, batch)  # (2b, T)
            sums, counts = logps.sum(-1), mask.sum(-1)
            pc, pr = sums[:b], sums[b:]
            if method == "dpo":
                nll = -logps[:b].sum() / mask[:b].sum().clamp(min=1) if config.rpo_alpha > 0 else None
                out = dpo_loss(pc, pr, ref_c[idx] if needs_ref else None, ref_r[idx] if needs_ref else None,
                               beta=beta, loss_type=config.loss_type, label_smoothing=config.label_smoothing,
                               reference_free=config.reference_free, chosen_lengths=counts[:b],
                               rejected_lengths=counts[b:], chosen_nll=nll, rpo_alpha=config.rpo_alpha)
            else:
                avg = sums / counts.clamp(min=1)
                if method == "simpo":
                    out = simpo_loss(avg[:b], avg[b:], beta=beta, gamma=config.simpo_gamma,
                                     label_smoothing=config.label_smoothing)
                else:  # orpo: mean NLL of the chosen completions' tokens + the odds-ratio term
                    nll = -logps[:b].sum() / mask[:b].sum().clamp(min=1)
                    out = orpo_loss(avg[:b], avg[b:], nll, beta=beta)
            return out.loss, preference_metrics(out, pc, pr)

    step, history, stopped = _fit(model, config, n_examples, step_fn, out_dir, progress=progress, print_fn=print_fn)
    return _finish(model, config, tokenizer, template, out_dir, data, step, history, stopped, method, print_fn)


