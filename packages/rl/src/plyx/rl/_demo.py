"""The post-training demonstration: pretrain -> SFT -> DPO on verifiable tasks, with held-out accuracy at each stage.

Everything is generated here (no download): the tasks (``plyx.rl._tasks``), a byte-level tokenizer with
ChatML's two special tokens, a small Llama-style plyx model. Stages:

1. pretrain on the tasks as plain text (``add 23 58 = 81``), packed, loss on every token;
2. held-out accuracy of the base model in the chat format (it has never seen the format);
3. SFT on chat conversations (assistant-only loss), accuracy again;
4. DPO (sigmoid loss plus the chosen answers' NLL, RPO's ``rpo_alpha``): chosen = the correct answer,
   rejected = the SFT model's own wrong greedy answer where it has one, else a corrupted correct answer
   (one character changed or two swapped); accuracy again;
5. the control: the SFT model trained on the DPO stage's chosen answers alone, same steps and learning
   rate (the NLL part of the DPO stage without the preference term), accuracy again.

``DemoSizes`` sets every size; ``bench/demo.py`` runs the documented one, the tests a much smaller one.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from plyx.rl._chat import ChatTemplate
from plyx.rl._tasks import Task, corrupt, greedy_answers, make_tasks, score

__all__ = ["CHATML", "DemoSizes", "build_tokenizer", "run_demo", "write_jsonl"]

#: ChatML with {% generation %} around the assistant's text (transformers' assistant-mask convention)
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>")


@attrs.frozen(kw_only=True)
class DemoSizes:
    """Sizes of one demonstration run (defaults: the documented CPU run)."""

    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    train_tasks: int = 4000
    test_tasks: int = 400
    dpo_pairs: int = 1000
    pretrain_steps: int = 300
    sft_steps: int = 250
    dpo_steps: int = 60
    batch_size: int = 32
    pretrain_lr: float = 3e-3
    sft_lr: float = 1e-3
    dpo_lr: float = 2e-5
    beta: float = 0.1
    rpo_alpha: float = 1.0
    control: bool = True
    """Also run the control: SFT on the chosen answers with DPO's steps and learning rate (RPO's NLL part alone)."""
    seed: int = 0


def build_tokenizer(out_dir: Path, template: str = CHATML) -> Any:
    """A byte-level tokenizer (bytes + end-of-text, no merges) with ChatML's specials; written with the template.

    Returns the ``plyx.train.Tokenizer``; ``out_dir`` gets ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    from plyx.train import Tokenizer, train_bpe

    tok = train_bpe(["0123456789 abcdefghijklmnopqrstuvwxyz-/=\n"], vocab_size=257)  # 256 bytes + EOS: no merges
    tok.inner.add_special_tokens(list(SPECIALS))
    tok = Tokenizer(tok.inner, eos_token=tok.eos_token)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(out_dir / "tokenizer.json")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": tok.eos_token, "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n", encoding="utf-8")
    return tok


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _model(sizes: DemoSizes, vocab: int) -> Any:
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(sizes.seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, d_model=sizes.d_model, n_layers=sizes.n_layers,
                      n_heads=sizes.n_heads, d_ff=sizes.d_model * 8 // 3 // 8 * 8, max_seq_len=128,
                      tie_embeddings=True)
    return TransformerLM(cfg)


def run_demo(out_dir: str | Path, sizes: DemoSizes = DemoSizes(), *, progress: bool = False,
             print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the four stages into ``out_dir``; returns the accuracies, timings and sizes (also ``results.json``)."""
    from plyx.rl._config import PreferenceConfig, SFTConfig
    from plyx.rl._run import preference, sft
    from plyx.specs import OptimizerConfig, ScheduleConfig

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    tok = build_tokenizer(root / "tokenizer")
    template = ChatTemplate(CHATML, eos_token=tok.eos_token, name="chatml")
    train = make_tasks(sizes.train_tasks, split="train", seed=sizes.seed)
    test = make_tasks(sizes.test_tasks, split="test", seed=sizes.seed)
    sft_tasks, dpo_tasks = train[sizes.dpo_pairs:], train[: sizes.dpo_pairs]
    vocab = (tok.vocab_size + 63) // 64 * 64
    model = _model(sizes, vocab)
    common: dict[str, Any] = {"batch_size": sizes.batch_size, "seed": sizes.seed, "device": "cpu", "max_length": 64,
                              "log_every": 25}

    def accuracy(m: Any, tasks: list[Task]) -> tuple[dict[str, float], list[str]]:
        answers = greedy_answers(m, tok, template, tasks)
        return score(answers, tasks), answers

    # 1. pretrain on plain task text, packed
    t = time.perf_counter()
    write_jsonl(root / "pretrain.jsonl", [{"text": f"{x.prompt} = {x.answer}\n"} for x in train])
    pre = sft(SFTConfig(data=str(root / "pretrain.jsonl"), out_dir=str(root / "pretrain"), packing=True,
                        steps=sizes.pretrain_steps, optimizer=OptimizerConfig(lr=sizes.pretrain_lr, weight_decay=0.0),
                        schedule=ScheduleConfig(kind="cosine", warmup_steps=20, min_lr_ratio=0.1), **common),
              model=model, tokenizer=tok, template=template, overwrite=True, progress=progress, print_fn=print_fn)
    times["pretrain_s"] = time.perf_counter() - t
    base, _ = accuracy(pre.model, test)
    print_fn(f"held-out accuracy before SFT: {base['accuracy']:.3f}")

    # 2. SFT on conversations, assistant-only loss
    t = time.perf_counter()
    write_jsonl(root / "sft.jsonl", [{"messages": x.messages()} for x in sft_tasks])
    tuned = sft(SFTConfig(data=str(root / "sft.jsonl"), out_dir=str(root / "sft"), steps=sizes.sft_steps,
                          optimizer=OptimizerConfig(lr=sizes.sft_lr, weight_decay=0.0),
                          schedule=ScheduleConfig(kind="cosine", warmup_steps=20, min_lr_ratio=0.1), **common),
                model=pre.model, tokenizer=tok, template=template, overwrite=True, progress=progress,
                print_fn=print_fn)
    times["sft_s"] = time.perf_counter() - t
    after_sft, _ = accuracy(tuned.model, test)
    print_fn(f"held-out accuracy after SFT: {after_sft['accuracy']:.3f}")

    # 3. DPO: correct vs the SFT model's own mistake (or a corruption of the answer)
    t = time.perf_counter()
    own = greedy_answers(tuned.model, tok, template, dpo_tasks)
    rng = random.Random(sizes.seed)
    pairs, on_policy = [], 0
    for task, answer in zip(dpo_tasks, own):
        if answer != task.answer and answer:
            rejected, on_policy = answer, on_policy + 1
        else:
            rejected = corrupt(task, rng)
        pairs.append({"prompt": [{"role": "user", "content": task.prompt}], "chosen": task.answer,
                      "rejected": rejected})
    write_jsonl(root / "dpo.jsonl", pairs)
    times["dpo_pairs_s"] = time.perf_counter() - t
    control_acc = None
    if sizes.control:
        # the control: the same steps, learning rate and batches of chosen answers as plain SFT (the NLL part of
        # the DPO stage alone), from a copy of the SFT model; what DPO adds is the difference to this
        t = time.perf_counter()
        write_jsonl(root / "control.jsonl", [{"messages": x.messages()} for x in dpo_tasks])
        control = sft(SFTConfig(data=str(root / "control.jsonl"), out_dir=str(root / "control"), steps=sizes.dpo_steps,
                                optimizer=OptimizerConfig(lr=sizes.dpo_lr, weight_decay=0.0),
                                schedule=ScheduleConfig(kind="constant", warmup_steps=10), **common),
                      model=copy.deepcopy(tuned.model), tokenizer=tok, template=template, overwrite=True,
                      progress=progress, print_fn=print_fn)
        times["control_s"] = time.perf_counter() - t
        control_acc, _ = accuracy(control.model, test)
        print_fn(f"held-out accuracy after the control (SFT on the chosen answers only): {control_acc['accuracy']:.3f}")
        t = time.perf_counter()
    tuned_pref = preference(
        PreferenceConfig(method="dpo", beta=sizes.beta, rpo_alpha=sizes.rpo_alpha, data=str(root / "dpo.jsonl"), out_dir=str(root / "dpo"),
                         steps=sizes.dpo_steps, optimizer=OptimizerConfig(lr=sizes.dpo_lr, weight_decay=0.0),
                         schedule=ScheduleConfig(kind="constant", warmup_steps=10), **common),
        model=tuned.model, tokenizer=tok, template=template, overwrite=True, progress=progress, print_fn=print_fn)
    times["dpo_s"] = time.perf_counter() - t + times.pop("dpo_pairs_s")
    after_dpo, _ = accuracy(tuned_pref.model, test)
    print_fn(f"held-out accuracy after DPO: {after_dpo['accuracy']:.3f}")
    result = {
        "accuracy": {"before_sft": base, "after_sft": after_sft, "after_dpo": after_dpo,
                     **({"control_sft_on_chosen": control_acc} if control_acc is not None else {})},
        "dpo": {"pairs": len(pairs), "on_policy_rejected": on_policy, "final": tuned_pref.metrics},
        "sft_final": tuned.metrics, "pretrain_final": pre.metrics,
        "times_s": times, "sizes": attrs.asdict(sizes),
        "params": sum(p.numel() for p in tuned_pref.model.parameters()),
        "test_tasks": len(test), "train_tasks": len(train),
    }
    (root / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result
