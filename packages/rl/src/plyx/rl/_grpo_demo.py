"""The GRPO demonstration: the part-1 SFT model, then GRPO with an exact-match reward; held-out accuracy of each.

Stages (everything generated here, as in ``plyx.rl._demo``):

1. pretrain a small Llama-style plyx model on the tasks as plain text, then SFT it on chat conversations
   (``plyx.rl._demo``'s stages 1-3, same sizes): the starting point;
2. held-out accuracy of the SFT model (greedy, exact match): on the demo's 400 mixed tasks and on
   ``task_tests`` held-out tasks of the GRPO stage's kind (``grpo_kinds``, default ``sort``: the kind the SFT
   model gets partly right, so groups of samples disagree and carry a signal);
3. GRPO (``plyx rl grpo``'s loop: engine sampling, exact-match reward, group advantages, clipped updates,
   in-place weight sync) on training prompts of that kind the SFT stage never saw, accuracy again;
4. the control: the SFT model trained further with plain SFT on the same prompts' correct answers for the
   same number of optimizer steps and learning rate (what more supervised data alone gives), accuracy again.

``GRPODemoSizes`` sets every size; ``bench/grpo_demo.py`` runs the documented one, the tests a tiny one.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from plyx.rl._chat import ChatTemplate
from plyx.rl._demo import CHATML, DemoSizes, _model, build_tokenizer, write_jsonl
from plyx.rl._tasks import greedy_answers, make_tasks, score

__all__ = ["GRPODemoSizes", "run_grpo_demo"]


@attrs.frozen(kw_only=True)
class GRPODemoSizes:
    """Sizes of one GRPO demonstration (defaults: the documented CPU run)."""

    base: DemoSizes = DemoSizes(control=False)
    """The pretrain and SFT stages (``plyx.rl._demo.DemoSizes``; its DPO fields are unused)."""
    grpo_kinds: tuple[str, ...] = ("sort",)
    """Task kinds of the GRPO stage's prompts (training split, none seen by SFT) and of its held-out test."""
    grpo_prompts: int = 1000
    """Training prompts of the GRPO stage."""
    task_tests: int = 400
    """Held-out tasks of ``grpo_kinds`` the stages are scored on (besides the 400 mixed ones)."""
    grpo_steps: int = 120
    prompts_per_step: int = 16
    num_generations: int = 8
    loss_type: str = "dapo"
    lr: float = 5e-5
    beta: float = 0.0
    temperature: float = 1.0
    max_new_tokens: int = 16
    control: bool = True
    """Also train the control: plain SFT on the GRPO prompts' correct answers, same steps and learning rate."""
    device: str = "cpu"
    precision: str = "float32"


def run_grpo_demo(out_dir: str | Path, sizes: GRPODemoSizes = GRPODemoSizes(), *, progress: bool = False,
                  print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the stages into ``out_dir``; returns accuracies, GRPO metrics, timings and sizes (also ``results.json``)."""
    from plyx.rl._config import SFTConfig
    from plyx.rl._grpo import grpo
    from plyx.rl._grpo_config import GRPOConfig, RewardSpec
    from plyx.rl._run import sft
    from plyx.specs import OptimizerConfig, ScheduleConfig

    b = sizes.base
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    tok = build_tokenizer(root / "tokenizer")
    template = ChatTemplate(CHATML, eos_token=tok.eos_token, name="chatml")
    train = make_tasks(b.train_tasks, split="train", seed=b.seed)
    test = make_tasks(b.test_tasks, split="test", seed=b.seed)
    sft_tasks = train[b.dpo_pairs:]  # the DPO demo's SFT data
    seen = {x.prompt for x in sft_tasks}
    # GRPO's prompts: training-split tasks of grpo_kinds the SFT stage never saw (another seed's draw)
    rl_tasks = [x for x in make_tasks(sizes.grpo_prompts * 3, split="train", seed=b.seed + 1, kinds=sizes.grpo_kinds)
                if x.prompt not in seen][: sizes.grpo_prompts]
    task_test = make_tasks(sizes.task_tests, split="test", seed=b.seed, kinds=sizes.grpo_kinds)
    vocab = (tok.vocab_size + 63) // 64 * 64
    device = sizes.device
    model = _model(b, vocab).to(device)
    common: dict[str, Any] = {"batch_size": b.batch_size, "seed": b.seed, "device": device, "max_length": 64,
                              "log_every": 25, "precision": sizes.precision}

    def accuracy(m: Any) -> dict[str, Any]:
        mixed = score(greedy_answers(m, tok, template, test), test)
        mixed["task"] = score(greedy_answers(m, tok, template, task_test), task_test)["accuracy"]
        return mixed

    t = time.perf_counter()
    write_jsonl(root / "pretrain.jsonl", [{"text": f"{x.prompt} = {x.answer}\n"} for x in train])
    pre = sft(SFTConfig(data=str(root / "pretrain.jsonl"), out_dir=str(root / "pretrain"), packing=True,
                        steps=b.pretrain_steps, optimizer=OptimizerConfig(lr=b.pretrain_lr, weight_decay=0.0),
                        schedule=ScheduleConfig(kind="cosine", warmup_steps=20, min_lr_ratio=0.1), **common),
              model=model, tokenizer=tok, template=template, overwrite=True, progress=progress, print_fn=print_fn)
    times["pretrain_s"] = time.perf_counter() - t
    t = time.perf_counter()
    write_jsonl(root / "sft.jsonl", [{"messages": x.messages()} for x in sft_tasks])
    tuned = sft(SFTConfig(data=str(root / "sft.jsonl"), out_dir=str(root / "sft"), steps=b.sft_steps,
                          optimizer=OptimizerConfig(lr=b.sft_lr, weight_decay=0.0),
                          schedule=ScheduleConfig(kind="cosine", warmup_steps=20, min_lr_ratio=0.1), **common),
                model=pre.model, tokenizer=tok, template=template, overwrite=True, progress=progress,
                print_fn=print_fn)
    times["sft_s"] = time.perf_counter() - t
    after_sft = accuracy(tuned.model)
    print_fn(f"held-out accuracy after SFT: {after_sft['accuracy']:.3f} (mixed), {after_sft['task']:.3f} "
             f"({'/'.join(sizes.grpo_kinds)})")
    sft_state = copy.deepcopy(tuned.model.state_dict())

    # GRPO on prompts SFT never saw
    write_jsonl(root / "grpo.jsonl", [{"prompt": [{"role": "user", "content": x.prompt}], "answer": x.answer,
                                       "kind": x.kind} for x in rl_tasks])
    t = time.perf_counter()
    result = grpo(GRPOConfig(
        data=str(root / "grpo.jsonl"), out_dir=str(root / "grpo"), steps=sizes.grpo_steps,
        batch_size=sizes.prompts_per_step, num_generations=sizes.num_generations, loss_type=sizes.loss_type,
        beta=sizes.beta, temperature=sizes.temperature, max_new_tokens=sizes.max_new_tokens, max_length=64,
        optimizer=OptimizerConfig(lr=sizes.lr, weight_decay=0.0), schedule=ScheduleConfig(kind="constant",
                                                                                           warmup_steps=0),
        rewards=(RewardSpec(name="exact_match"),), seed=b.seed, device=device, precision=sizes.precision,
        log_every=10), model=tuned.model, tokenizer=tok, template=template, overwrite=True, progress=progress,
        print_fn=print_fn)
    times["grpo_s"] = time.perf_counter() - t
    after_grpo = accuracy(result.model)
    print_fn(f"held-out accuracy after GRPO: {after_grpo['accuracy']:.3f} (mixed), {after_grpo['task']:.3f} "
             f"({'/'.join(sizes.grpo_kinds)})")
    hist = result.history
    grpo_summary = {
        "updates": sum(1 for r in hist if r["groups_trained"] > 0),
        "train_accuracy_first10": sum(r["accuracy"] for r in hist[:10]) / max(1, len(hist[:10])),
        "train_accuracy_last10": sum(r["accuracy"] for r in hist[-10:]) / max(1, len(hist[-10:])),
        "gen_share": sum(r["gen_s"] for r in hist) / max(1e-9, sum(r["gen_s"] + r["train_s"] + r["sync_s"]
                                                                  for r in hist)),
        "sync_ms_mean": 1e3 * sum(r["sync_s"] for r in hist) / max(1, sum(1 for r in hist if r["sync_s"] > 0)),
        "all_equal_groups": hist[-1]["all_equal_groups"] if hist else 0,
        "dropped_groups": hist[-1]["dropped_groups"] if hist else 0,
        "samples_per_s": sum(r["samples_per_s"] for r in hist) / max(1, len(hist)),
        "final": hist[-1] if hist else {},
    }

    control_acc = None
    if sizes.control:
        tuned.model.load_state_dict(sft_state)
        t = time.perf_counter()
        write_jsonl(root / "control.jsonl", [{"messages": x.messages()} for x in rl_tasks])
        updates = max(1, grpo_summary["updates"])
        control = sft(SFTConfig(data=str(root / "control.jsonl"), out_dir=str(root / "control"), steps=updates,
                                optimizer=OptimizerConfig(lr=sizes.lr, weight_decay=0.0),
                                schedule=ScheduleConfig(kind="constant", warmup_steps=0), **common),
                      model=tuned.model, tokenizer=tok, template=template, overwrite=True, progress=progress,
                      print_fn=print_fn)
        times["control_s"] = time.perf_counter() - t
        control_acc = accuracy(control.model)
        print_fn(f"held-out accuracy after the control (SFT on the GRPO prompts' answers): "
                 f"{control_acc['accuracy']:.3f} (mixed), {control_acc['task']:.3f}")
    out = {
        "accuracy": {"after_sft": after_sft, "after_grpo": after_grpo,
                     **({"control_sft_on_answers": control_acc} if control_acc is not None else {})},
        "grpo": grpo_summary, "times_s": times,
        "sizes": {**attrs.asdict(sizes), "base": attrs.asdict(b)},
        "params": sum(p.numel() for p in result.model.parameters()),
        "test_tasks": len(test), "task_tests": len(task_test), "grpo_prompts": len(rl_tasks),
        "sft_tasks": len(sft_tasks),
    }
    (root / "results.json").write_text(json.dumps(out, indent=2, default=float) + "\n", encoding="utf-8")
    return out
