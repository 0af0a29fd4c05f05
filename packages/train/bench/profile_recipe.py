"""Where an iteration of ``plyx train shakespeare-char`` (nanoGPT's CPU recipe) spends its time, by category.

cProfile over ``Trainer.fit`` for N steps of the shipped recipe (no evaluation, no checkpoints,
no samples), attributed to: backward, the matmuls (``linear``), attention (SDPA), RoPE, RMSNorm,
SwiGLU, the loss, the optimizer, the kernel registry's dispatch, metrics, and the rest of the loop.
The categories that nanoGPT's GPT-2 block does not have (RoPE, RMSNorm as separate ops, SwiGLU's
third matmul) are the architectural share of the per-iteration gap; dispatch, metrics and the
loop are the framework's.

    python packages/train/bench/profile_recipe.py --steps 150 --threads 2

Prints a table and appends a JSON record to ``bench/results/profile_recipe.jsonl``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import tempfile
import time
from pathlib import Path

import torch
from plyx.specs import ScheduleConfig, TrainConfig, load_config
from plyx.train import Trainer, TrainOptions
from plyx.train._cli import shipped_configs

# (category, predicate on (file, function name)) in priority order; self time of matching functions
CATEGORIES = [
    ("backward", lambda f, n: n == "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("linear (matmuls)", lambda f, n: "_nn.linear" in n),
    ("attention (sdpa)", lambda f, n: "scaled_dot_product_attention" in n or "attn/_attention.py" in f),
    ("rope", lambda f, n: "reference/rope.py" in f),
    ("rmsnorm", lambda f, n: "reference/rmsnorm.py" in f or "'pow' of" in n or "rsqrt" in n),
    ("swiglu", lambda f, n: "reference/swiglu.py" in f or "_nn.silu" in n),
    ("loss", lambda f, n: "linear_cross_entropy" in f or "logsumexp" in n or "train/_loss.py" in f),
    ("optimizer", lambda f, n: "optim/" in f or "_fused_adamw" in n or "_foreach" in n or "clip_grad" in f),
    ("kernel dispatch", lambda f, n: "kernel/_registry.py" in f or "attn/_kernels.py" in f),
    ("metrics", lambda f, n: "train/_metrics.py" in f or "train/_progress.py" in f),
    ("module call", lambda f, n: "torch/nn/modules/module.py" in f),
    ("data", lambda f, n: "train/_dataset.py" in f or "train/_shards.py" in f),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_recipe.jsonl"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(TrainConfig, shipped_configs()["shakespeare-char"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.replace(steps=args.steps, eval_every=0, checkpoint_every=0, sample_tokens=0, device="cpu",
                          out_dir=str(Path(tmp) / "run"),
                          schedule=ScheduleConfig(kind="cosine", warmup_steps=min(100, args.steps // 10)))
        trainer = Trainer(cfg, options=TrainOptions(progress=False, tensorboard=False, handle_signals=False))
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        trainer.fit()
        prof.disable()
        wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    shares = {name: 0.0 for name, _ in CATEGORIES}
    rest = 0.0
    for (file, _line, func), (_cc, _nc, tottime, _cum, _callers) in stats.items():
        for name, match in CATEGORIES:
            if match(file, func):
                shares[name] += tottime
                break
        else:
            rest += tottime
    shares["rest (loop, python)"] = rest
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.steps} steps, {wall / args.steps * 1e3:.1f} ms/iter wall under cProfile, {args.threads} threads, "
          f"load average {load:.1f}")
    for name, seconds in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {name:22s} {seconds / args.steps * 1e3:8.2f} ms/iter  {seconds / total * 100:5.1f} %")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
        "threads": args.threads, "steps": args.steps, "load_average": load,
        "ms_per_iter_profiled": wall / args.steps * 1e3,
        "share_percent": {k: round(v / total * 100, 2) for k, v in shares.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
