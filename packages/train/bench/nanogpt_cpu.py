"""nanoGPT's CPU recipe, reproduced with plyx and with a plain PyTorch loop of the same model, in one run.

nanoGPT (README, "I only have a macbook"):

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

with train_shakespeare_char.py's learning_rate=1e-3, min_lr=1e-4, beta2=0.99, warmup_iters=100,
weight_decay=0.1, grad_clip=1.0, eval_interval=250 on character-level Tiny Shakespeare (90/10 split).
nanoGPT's GPT-2 block (LayerNorm, GELU MLP of 4 x 128, learned positions, tied head) reaches a
validation loss of about 1.88 with 0.80M parameters.

Both sides here train plyx's ``TransformerLM`` at that size (Llama block: RMSNorm, RoPE, SwiGLU with
d_ff=344 so the parameter count matches, tied head) from the same initial weights:

- ``plyx``: ``plyx.train.Trainer`` on shards written by ``plyx.train.write_shards``: its dataset,
  loss through the kernel registry's ``linear_cross_entropy``, metrics CSV, hooks, all of it.
- ``plain``: nanoGPT's ``train.py`` loop written out: ``torch.randint`` windows of a numpy array,
  ``F.cross_entropy`` on full logits, the same AdamW (fused, param groups), ``get_lr`` and clipping.

The two loops are interleaved in chunks (the plain loop runs inside plyx's step-end hook), so
both see the same machine load; per-iteration time is the wall time between consecutive
iteration ends, leaving out iterations that contained an evaluation or the other loop's chunk.
Validation loss is measured on the same fixed validation batches for both.

Usage::

    python packages/train/bench/nanogpt_cpu.py                 # 2000 iterations, 2 threads
    python packages/train/bench/nanogpt_cpu.py --iters 500 --threads 2

Results are printed as a table and appended to ``bench/results.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from plyx.model import TransformerLM
from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig, hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import Trainer, TrainOptions, bundled_corpus, write_shards

HERE = Path(__file__).resolve().parent

# nanoGPT's CPU recipe (sizes live here, not inline)
RECIPE = {
    "block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128, "max_iters": 2000,
    "lr_decay_iters": 2000, "learning_rate": 1e-3, "min_lr": 1e-4, "beta1": 0.9, "beta2": 0.99,
    "warmup_iters": 100, "weight_decay": 0.1, "grad_clip": 1.0, "eval_interval": 250, "eval_iters": 20,
}
#: SwiGLU width giving nanoGPT's parameter count: 3 * 128 * 344 ~= 2 * 128 * 512
D_FF = 344
#: ``--tiny``: a model so small that the step time is mostly loop overhead (what the framework adds, in ms)
TINY = {"block_size": 8, "batch_size": 2, "n_layer": 1, "n_head": 2, "n_embd": 16, "eval_interval": 10**9, "d_ff": 32}
SEED = 1337
FINAL_EVAL_BATCHES = 200


def warmup_for(iters: int) -> int:
    """nanoGPT's 100 warmup iterations; a quarter of the run when it has fewer than 400 (``--iters``)."""
    return min(RECIPE["warmup_iters"], iters // 4)


def char_data() -> tuple[np.ndarray, np.ndarray, int]:
    """nanoGPT's data/shakespeare_char/prepare.py: sorted characters as ids, first 90 % train."""
    text = bundled_corpus().read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    return ids[:n], ids[n:], len(chars)


def model_config(vocab: int, max_iters: int) -> ModelConfig:
    r = RECIPE
    return ModelConfig(vocab_size=vocab, d_model=r["n_embd"], n_layers=r["n_layer"], n_heads=r["n_head"],
                       d_ff=r.get("d_ff", D_FF),
                       max_seq_len=r["block_size"], tie_embeddings=True)


class Evaluator:
    """Mean loss over fixed validation windows (the same ones for both sides)."""

    def __init__(self, val: np.ndarray, batches: int) -> None:
        gen = torch.Generator().manual_seed(SEED + 1)
        T, B = RECIPE["block_size"], RECIPE["batch_size"]
        data = torch.from_numpy(val.astype(np.int64))
        self.batches = []
        for _ in range(batches):
            ix = torch.randint(len(data) - T, (B,), generator=gen)
            x = torch.stack([data[i : i + T] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + T] for i in ix])
            self.batches.append((x, y))

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, n: int | None = None) -> float:
        was = model.training
        model.eval()
        losses = [F.cross_entropy(model(x).view(-1, model.config.vocab_size), y.view(-1)).item()
                  for x, y in self.batches[:n]]
        model.train(was)
        return float(sum(losses) / len(losses))


class PlainLoop:
    """nanoGPT's train.py loop, step by step, around a TransformerLM."""

    def __init__(self, train: np.ndarray, vocab: int, iters: int, evaluator: Evaluator) -> None:
        r = RECIPE
        torch.manual_seed(SEED)  # the same initial weights as the Trainer's model
        self.model = TransformerLM(model_config(vocab, iters))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": r["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=r["learning_rate"], betas=(r["beta1"], r["beta2"]), fused=True)
        self.train = train
        self.gen = torch.Generator().manual_seed(SEED)
        self.iters, self.it = iters, 0
        self.evaluator = evaluator
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.chunks: list[tuple[list[float], list[float]]] = []  # (wall, cpu) times of each run() call
        self.losses: list[float] = []
        self.val: dict[int, float] = {}

    def get_lr(self, it: int) -> float:
        r = RECIPE
        warmup, decay_iters = warmup_for(self.iters), self.iters
        if it < warmup:
            return r["learning_rate"] * (it + 1) / (warmup + 1)
        if it > decay_iters:
            return r["min_lr"]
        ratio = (it - warmup) / (decay_iters - warmup)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return r["min_lr"] + coeff * (r["learning_rate"] - r["min_lr"])

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        T, B = RECIPE["block_size"], RECIPE["batch_size"]
        data = self.train
        ix = torch.randint(len(data) - T, (B,), generator=self.gen)
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    def run(self, n: int) -> None:
        model, opt = self.model, self.optimizer
        t_last, c_last = time.perf_counter(), time.process_time()
        chunk: tuple[list[float], list[float]] = ([], [])
        self.chunks.append(chunk)
        for _ in range(n):
            if self.it >= self.iters:
                return
            lr = self.get_lr(self.it)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = self.get_batch()
            logits = model(x)  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["grad_clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.losses.append(loss.item())  # nanoGPT's log_interval=1
            self.it += 1
            now, cpu = time.perf_counter(), time.process_time()
            evaluated = self.it % RECIPE["eval_interval"] == 0
            if evaluated:
                self.val[self.it] = self.evaluator(model, RECIPE["eval_iters"])
                now, cpu = time.perf_counter(), time.process_time()
            else:
                self.times.append(now - t_last)
                self.cpu_times.append(cpu - c_last)
                chunk[0].append(now - t_last)
                chunk[1].append(cpu - c_last)
            t_last, c_last = now, cpu


class Interleaver:
    """Step-end hook: records plyx's per-step times and runs a chunk of the plain loop every ``chunk`` steps."""

    def __init__(self, plain: PlainLoop, chunk: int, evaluator: Evaluator) -> None:
        self.plain, self.chunk, self.evaluator = plain, chunk, evaluator
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.val: dict[int, float] = {}
        self.trainer: Trainer | None = None
        self.t_last: float | None = None
        self.c_last = 0.0
        self.chunks: list[tuple[list[float], list[float]]] = [([], [])]

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict[str, float]) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.t_last is not None:
            self.times.append(now - self.t_last)
            self.cpu_times.append(cpu - self.c_last)
            self.chunks[-1][0].append(now - self.t_last)
            self.chunks[-1][1].append(cpu - self.c_last)
        self.t_last, self.c_last = now, cpu
        disturbed = False
        if step % RECIPE["eval_interval"] == 0 and self.trainer is not None:
            self.val[step] = self.evaluator(self.trainer.module, RECIPE["eval_iters"])
            disturbed = True
        if step % self.chunk == 0:
            self.plain.run(self.chunk)
            self.chunks.append(([], []))
            disturbed = True
            print(f"  plyx step {step}, plain iteration {self.plain.it}, last losses {metrics['loss']:.3f} / "
                  f"{self.plain.losses[-1]:.3f}", file=sys.stderr, flush=True)
        if disturbed:
            self.t_last = None  # the next interval would include this work: not counted


def paired_ratio(plyx: list[tuple[list[float], list[float]]], plain: list[tuple[list[float], list[float]]],
                 which: int) -> float:
    """Median over neighbouring chunk pairs of median(plyx chunk) / median(plain chunk).

    Each plyx chunk of ``--chunk`` steps is followed by a plain chunk, so a pair shares the
    machine's load of that moment; this cancels the slow drift of a shared machine.
    """
    ratios = [statistics.median(a[which]) / statistics.median(b[which])
              for a, b in zip(plyx, plain) if len(a[which]) >= 3 and len(b[which]) >= 3]
    return statistics.median(ratios) if ratios else float("nan")


def summary(times: list[float], cpu_times: list[float], tokens_per_iter: int) -> dict[str, float]:
    """Wall-clock medians and means; CPU time (all threads) is less sensitive to other load on the machine."""
    med = statistics.median(times)
    return {"ms_per_iter_median": med * 1e3, "ms_per_iter_mean": statistics.fmean(times) * 1e3,
            "cpu_ms_per_iter_median": statistics.median(cpu_times) * 1e3,
            "tokens_per_s": tokens_per_iter / med, "timed_iters": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=RECIPE["max_iters"], help="iterations per side (nanoGPT: 2000)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the CI machine has 2 cores)")
    ap.add_argument("--chunk", type=int, default=50, help="iterations per interleaved chunk")
    ap.add_argument("--tiny", action="store_true", help="a 1-layer 16-wide model on 2x8 tokens: measures the "
                    "loop overhead itself in ms (validation losses are meaningless there)")
    ap.add_argument("--out", default=str(HERE / "results.jsonl"), help="JSON lines file the result is appended to")
    args = ap.parse_args()
    if args.tiny:
        RECIPE.update(TINY)  # the sizes every function below reads
    torch.set_num_threads(args.threads)
    r = RECIPE
    train, val, vocab = char_data()
    evaluator = Evaluator(val, FINAL_EVAL_BATCHES)
    tokens_per_iter = r["batch_size"] * r["block_size"]

    with tempfile.TemporaryDirectory(prefix="plyx-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        write_shards(data_dir, {"train": [train], "val": [val]}, vocab_size=vocab, eos_id=None,
                     extra={"corpus": "tinyshakespeare (char-level)"})
        config = TrainConfig(
            model=model_config(vocab, args.iters),
            data=DataConfig(path=str(data_dir), seq_len=r["block_size"], mode="windows"),
            optimizer=OptimizerConfig(name="adamw", lr=r["learning_rate"], weight_decay=r["weight_decay"],
                                      betas=(r["beta1"], r["beta2"]), grad_clip=r["grad_clip"]),
            schedule=ScheduleConfig(kind="cosine", warmup_steps=warmup_for(args.iters),
                                    min_lr_ratio=r["min_lr"] / r["learning_rate"]),
            seed=SEED, steps=args.iters, batch_size=r["batch_size"], device="cpu", out_dir=str(Path(tmp) / "run"),
            log_every=10, eval_every=0, checkpoint_every=0, sample_tokens=0,
        )
        plain = PlainLoop(train, vocab, args.iters, evaluator)
        hook = Interleaver(plain, args.chunk, evaluator)
        trainer = Trainer(config, options=TrainOptions(progress=False, tensorboard=False, handle_signals=False))
        hook.trainer = trainer
        same_init = all(torch.equal(a, b) for a, b in zip(trainer.module.state_dict().values(),
                                                             plain.model.state_dict().values()))
        register_plugin(hook, "bench-interleaver")
        t0 = time.perf_counter()
        try:
            result = trainer.fit()
        finally:
            unregister_plugin("bench-interleaver")
        plain.run(args.iters)  # whatever is left of the plain loop
        wall = time.perf_counter() - t0
        final = {"plyx": evaluator(trainer.module), "plain": evaluator(plain.model)}

    sides = {
        "plyx": {**summary(hook.times, hook.cpu_times, tokens_per_iter), "final_val_loss": final["plyx"],
                 "final_train_loss": statistics.fmean(result.losses[-50:]), "val_curve": hook.val},
        "plain": {**summary(plain.times, plain.cpu_times, tokens_per_iter), "final_val_loss": final["plain"],
                  "final_train_loss": statistics.fmean(plain.losses[-50:]), "val_curve": plain.val},
    }
    ratio = sides["plyx"]["ms_per_iter_median"] / sides["plain"]["ms_per_iter_median"]
    cpu_ratio = sides["plyx"]["cpu_ms_per_iter_median"] / sides["plain"]["cpu_ms_per_iter_median"]
    paired = {"wall": paired_ratio(hook.chunks, plain.chunks, 0), "cpu": paired_ratio(hook.chunks, plain.chunks, 1)}
    overhead_ms = sides["plyx"]["ms_per_iter_median"] - sides["plain"]["ms_per_iter_median"]
    record = {
        "bench": "nanogpt_cpu",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__, "loadavg_end": os.getloadavg()},
        "iters": args.iters,
        "params": trainer.module.num_params(),
        "same_initial_weights": same_init,
        "wall_s": wall,
        "plyx_over_plain_time": ratio,
        "plyx_over_plain_cpu_time": cpu_ratio,
        "plyx_over_plain_paired": paired,
        "plyx_minus_plain_ms": overhead_ms,
        "mode": "tiny" if args.tiny else "recipe",
        "sides": sides,
    }
    with open(args.out, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")

    print(f"nanoGPT CPU recipe{' (--tiny: loop overhead)' if args.tiny else ''}, {args.iters} iterations, {record['params']:,} parameters, "
          f"{args.threads} threads, same initial weights: {same_init}")
    print(f"{'':<6} {'ms/iter (median)':>17} {'ms/iter (mean)':>15} {'CPU ms/iter':>12} {'tokens/s':>9} "
          f"{'val loss':>9}  val curve")
    for name, s in sides.items():
        curve = " ".join(f"{k}:{v:.3f}" for k, v in s["val_curve"].items())
        print(f"{name:<6} {s['ms_per_iter_median']:>17.1f} {s['ms_per_iter_mean']:>15.1f} "
              f"{s['cpu_ms_per_iter_median']:>12.1f} {s['tokens_per_s']:>9.0f} {s['final_val_loss']:>9.4f}  {curve}")
    print(f"plyx / plain per iteration: wall {ratio:.3f}, CPU {cpu_ratio:.3f}, paired chunks wall {paired['wall']:.3f} "
          f"CPU {paired['cpu']:.3f} (target <= 1.05); plyx - plain = {overhead_ms:.2f} ms/iter; "
          f"load average at the end {os.getloadavg()[0]:.1f}; appended to {args.out}")


if __name__ == "__main__":
    main()
