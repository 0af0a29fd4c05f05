"""Where one training step of ``plyx train shakespeare-char`` and of nanoGPT's GPT goes, op by op, on CPU.

The two steps of ``step_vs_nanogpt.py`` (same batches, optimizer settings, clipping), profiled three ways:

1. ``torch.profiler`` over ``--steps`` steps of each at the recipe's size (12 x 64 tokens): self CPU time per
   aten op, grouped into categories (GEMMs, attention, norm, MLP activation, RoPE, loss, optimizer, copies and
   views, the rest), per step;
2. the aten ops each step dispatches (forward, backward, optimizer), counted with a ``TorchDispatchMode``;
3. the fixed cost: forward / backward / optimizer CPU time at 1 x 8 tokens, where the tensors are tiny and the
   time is Python and dispatch, and ``cProfile``'s top Python functions of plyx's forward there.

    python packages/train/bench/profile_step.py [--threads 1] [--steps 20] [--allocator plyx|glibc] [--out DIR]

Prints the tables and writes ``profile-step-cpu-<date>.json`` and ``.txt`` under ``--out`` (default
bench/results). Under load the absolute times stretch; the categories' shares and the op counts do not.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from step_vs_nanogpt import _sides, _step, recipe_setup  # noqa: E402  (the bench's own two steps and setup)

#: (category, predicate on the aten op's name), first match wins
CATEGORIES = [
    ("gemm", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv")),
    ("attention", lambda n: "scaled_dot_product" in n),
    ("norm", lambda n: "layer_norm" in n or n in ("aten::linalg_vector_norm", "aten::rsqrt_", "aten::rsqrt",
                                                   "aten::addcmul_", "aten::pow_", "aten::div_")),
    ("mlp activation", lambda n: "silu" in n or "gelu" in n),
    ("rope", lambda n: "complex" in n or "view_as_real" in n),
    ("loss", lambda n: "softmax" in n or "nll_loss" in n or "cross_entropy" in n),
    ("optimizer", lambda n: "adam" in n or "_foreach" in n),
    ("elementwise mul/add", lambda n: n in ("aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sum",
                                            "aten::mean", "aten::div")),
    ("copies (cat, clone, to)", lambda n: n in ("aten::cat", "aten::clone", "aten::copy_", "aten::_to_copy",
                                                "aten::index_select", "aten::embedding_dense_backward")),
]


def _category(name: str) -> str:
    for cat, pred in CATEGORIES:
        if pred(name):
            return cat
    return "rest (views, dispatch, autograd)"


def _batch(B: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 65, (B, T + 1), generator=gen)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (ids, targets) as get_batch


def profile_ops(sides: dict[str, Any], batch: tuple[torch.Tensor, ...], steps: int) -> dict[str, Any]:
    """Self CPU ms per step by aten op and by category, each side."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for name, (fn, opt, params) in sides.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                _step(fn, opt, params, *batch, 1.0)
        ops: dict[str, float] = collections.Counter()
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                ops[e.key] += e.self_cpu_time_total / 1e3 / steps
        cats: dict[str, float] = collections.Counter()
        for op, ms in ops.items():
            cats[_category(op)] += ms
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3 / steps
        cats["python autograd.Function / profiler rest"] = total - sum(ops.values())
        out[name] = {"total_ms": total, "categories": dict(cats),
                     "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:25])}
    return out


def count_ops(sides: dict[str, Any], batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """aten ops dispatched per step (nested ones included), forward / backward / optimizer, each side."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    out: dict[str, Any] = {}
    for name, (fn, opt, params) in sides.items():
        with Count() as f:
            loss = fn(*batch)
        with Count() as b:
            loss.backward()
        with Count() as o:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = {"forward": sum(f.ops.values()), "backward": sum(b.ops.values()), "optimizer": sum(o.ops.values()),
                     "forward_ops": dict(f.ops.most_common()), "backward_ops": dict(b.ops.most_common())}
    return out


def fixed_cost(sides: dict[str, Any], iters: int) -> dict[str, Any]:
    """CPU ms of forward / backward / optimizer at 1 x 8 tokens (medians), and plyx's forward under cProfile."""
    batch = _batch(1, 8)
    out: dict[str, Any] = {}
    for name, (fn, opt, params) in sides.items():
        for _ in range(20):
            _step(fn, opt, params, *batch, 1.0)
        parts: list[tuple[float, float, float]] = []
        for _ in range(iters):
            t0 = time.process_time()
            loss = fn(*batch)
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            parts.append((t1 - t0, t2 - t1, time.process_time() - t2))
        fwd, bwd, optim = (1e3 * statistics.median(p) for p in zip(*parts))
        out[name] = {"forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": optim}
    fn = sides["plyx"][0]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn(*batch)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(r"plyx|torch/nn/modules|autograd/function", 20)
    out["plyx_forward_cprofile"] = text.getvalue().split("\n", 6)[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="profiled steps of each side")
    p.add_argument("--iters", type=int, default=200, help="steps of each side timed at 1 x 8 tokens")
    p.add_argument("--allocator", choices=("plyx", "glibc"), default="plyx",
                   help="plyx: the allocator setting `plyx train` applies on CPU; glibc: its defaults")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator, config = recipe_setup(args.allocator)
    B, T = config.batch_size, config.model.max_seq_len
    sides = _sides(config)
    batch = _batch(B, T)
    for fn, opt, params in sides.values():  # warm: the optimizer's state, the kernels' caches
        for _ in range(10):
            _step(fn, opt, params, *batch, 1.0)
    ops = profile_ops(sides, batch, args.steps)
    counts = count_ops(sides, batch)
    fixed = fixed_cost(sides, args.iters)
    date = datetime.date.today().isoformat()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    lines = [f"cpu ({platform.machine()}), torch {torch.__version__}, {args.threads} threads, allocator {allocator}, "
             f"{date}, load {load}", "",
             f"self CPU ms per step at {B} x {T} tokens (torch.profiler, {args.steps} steps each; its own overhead "
             "inflates the small ops):", "",
             "| category | plyx | nanoGPT | plyx - nanoGPT |", "|---|---|---|---|"]
    cats = sorted(set(ops["plyx"]["categories"]) | set(ops["nanogpt"]["categories"]),
                  key=lambda c: -max(ops["plyx"]["categories"].get(c, 0), ops["nanogpt"]["categories"].get(c, 0)))
    for cat in cats:
        a, b = ops["plyx"]["categories"].get(cat, 0.0), ops["nanogpt"]["categories"].get(cat, 0.0)
        lines.append(f"| {cat} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    a, b = ops["plyx"]["total_ms"], ops["nanogpt"]["total_ms"]
    lines += [f"| **total** | **{a:.2f}** | **{b:.2f}** | **{a - b:+.2f}** ({a / b:.3f}x) |", "",
              "aten ops dispatched per step (forward / backward / optimizer):", ""]
    for s in sides:
        c = counts[s]
        lines.append(f"- {s}: {c['forward']} / {c['backward']} / {c['optimizer']}")
    lines += ["", "fixed cost, CPU ms at 1 x 8 tokens (forward / backward / optimizer):", ""]
    for s in sides:
        f = fixed[s]
        lines.append(f"- {s}: {f['forward_ms']:.2f} / {f['backward_ms']:.2f} / {f['optimizer_ms']:.2f}")
    lines += ["", "plyx's forward at 1 x 8, cProfile (top Python functions by own time):", "",
              fixed["plyx_forward_cprofile"]]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"profile-step-cpu-{date}"
    row = {"date": date, "device": "cpu", "machine": platform.machine(), "torch": torch.__version__,
           "threads": args.threads, "allocator": allocator, "load_average": load, "batch": B, "seq_len": T,
           "steps": args.steps, "ops": ops, "op_counts": counts, "fixed_cost": fixed}
    for suffix, body in ((".json", json.dumps(row, indent=1)), (".txt", text + "\n")):
        tmp = stem.with_suffix(suffix + ".tmp")
        tmp.write_text(body)
        tmp.replace(stem.with_suffix(suffix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
