"""Per-iteration time of ``plyx train shakespeare-char``'s step against nanoGPT's own model, interleaved, CPU.

Issue 20 measured plyx 1.06-1.14x slower per iteration than nanoGPT itself on the char-level Tiny
Shakespeare recipe (0.80M parameters, 12 x 64 tokens, CPU). ``nanogpt_cpu.py`` compares plyx's Trainer with a
plain loop of *plyx's* model; this one compares the training step of the shipped recipe's model with
nanoGPT's GPT (``model.py`` written out below: GPT-2 block, LayerNorm without bias, GELU MLP of 4 x 128,
learned positions, tied head, ``F.scaled_dot_product_attention``, dropout 0), same batches, same optimizer
settings (fused AdamW, nanoGPT's param groups, clipping 1.0):

- ``plyx``: ``TransformerLM`` of ``configs/shakespeare-char.toml`` + ``lm_loss`` (the kernel registry's
  RMSNorm, RoPE, SwiGLU, attention and fused linear cross-entropy) + ``build_optimizer``;
- ``nanogpt``: ``GPT(ids)`` + ``F.cross_entropy`` on the full logits + ``torch.optim.AdamW(fused=True)``.

The machine is shared and loaded: the two steps alternate in chunks of ``--chunk`` iterations for
``--rounds`` rounds; each side's per-iteration time is the median over all its iterations, and the ratio
is also taken per round (median of the rounds' ratios). CPU time (``process_time``) is reported beside wall.

    python packages/train/bench/step_vs_nanogpt.py [--rounds 15 --chunk 20 --threads 2] [--out DIR]
    python packages/train/bench/step_vs_nanogpt.py --baseline 659e47f     # + plyx with that commit's references
    python packages/train/bench/step_vs_nanogpt.py --allocator glibc      # glibc's allocator defaults

``--allocator plyx`` (the default) applies the allocator setting that ``plyx train`` applies on CPU
(``plyx.train._cpu_alloc``: activations reused from the heap instead of page-faulted mmaps every step) before
either side runs; one process, so nanoGPT's step runs under it too.

``--baseline REF`` adds a third side, ``plyx@REF``: the same model with the reference kernels of git commit
REF (``swiglu``, ``rmsnorm``, ``rope``, ``rope_qk``, ``linear_cross_entropy``, read with ``git show`` and
registered above the installed ones only while that side runs), RoPE tables computed each step (explicit
positions, as before the model cached them) and q, k, v as three GEMMs (no ``stacked_for_training``, as before
plyx-attn 1.7): before and after measured in one process under the same load.

Appends a JSON line to ``<out>/step-vs-nanogpt-cpu-<date>.jsonl`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent


# -- nanoGPT's model.py (Karpathy), the parts the recipe uses --------------------------------------

class _LayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class _Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = _LayerNorm(d), _LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.h, C // self.h).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.h, C // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, C // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's GPT at the recipe's size (bias=False, dropout=0, weight tying, its init)."""

    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(_Block(d, n_head) for _ in range(n_layer))
        self.ln_f = _LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _nanogpt_optimizer(model: nn.Module, lr: float, wd: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


# -- the two steps ---------------------------------------------------------------------------------

def _sides(config: Any) -> dict[str, tuple[Any, Any, list[torch.Tensor]]]:
    from plyx.model import TransformerLM
    from plyx.specs import Batch
    from plyx.train import build_optimizer, lm_loss

    m, o = config.model, config.optimizer
    torch.manual_seed(1337)
    plyx_model = TransformerLM(m)
    plyx_opt = build_optimizer(plyx_model, o)

    def plyx_loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(plyx_model, Batch(input_ids=ids, targets=targets))

    torch.manual_seed(1337)
    gpt = GPT(65, m.max_seq_len, m.n_layers, m.n_heads, m.d_model)  # nanoGPT's 65 characters
    gpt_opt = _nanogpt_optimizer(gpt, o.lr, o.weight_decay, tuple(o.betas))
    return {"plyx": (plyx_loss, plyx_opt, list(plyx_model.parameters())),
            "nanogpt": (gpt, gpt_opt, list(gpt.parameters()))}


#: the reference kernels a ``--baseline`` side takes from its commit (rope before rope_qk, which imports it)
BASELINE_KERNELS = ("swiglu", "rmsnorm", "rope", "rope_qk", "linear_cross_entropy")


class Baseline:
    """``plyx@REF``: the model with commit REF's reference kernels, switched in around that side's chunks."""

    def __init__(self, ref: str, config: Any) -> None:
        import subprocess
        import sys
        import types

        from plyx.kernel import registry
        from plyx.model import TransformerLM
        from plyx.specs.kernels import KernelImpl
        from plyx.train import build_optimizer

        self.registry, self.impls = registry(), []
        alias = f"_plyx_baseline_rope_{abs(hash(ref))}"
        for name in BASELINE_KERNELS:
            path = f"packages/kernel/src/plyx/kernel/reference/{name}.py"
            try:
                src = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True,
                                     cwd=HERE).stdout
            except subprocess.CalledProcessError as e:
                raise SystemExit(f"--baseline {ref}: cannot read {path} there ({e.stderr.strip()}); "
                                 "pass a commit of this repository that has the reference kernels") from None
            src = src.replace("from plyx.kernel.reference.rope import", f"from {alias} import")
            module = types.ModuleType(f"{alias}_{name}")
            if name == "rope":
                sys.modules[alias] = module
            exec(compile(src, f"{ref}:{path}", "exec"), module.__dict__)
            self.impls.append(KernelImpl(name, "baseline", getattr(module, name), priority=100))
        m = config.model
        torch.manual_seed(1337)
        self.model = TransformerLM(m)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.positions = torch.arange(m.max_seq_len)

    def enter(self) -> None:
        import plyx.attn._attention as attention

        for impl in self.impls:
            self.registry.register(impl)
        # before the stacked CPU training projection (plyx-attn 1.7): q, k and v as three GEMMs, rope_qk on each
        self._stacked = getattr(attention, "stacked_for_training", None)
        if self._stacked is not None:
            attention.stacked_for_training = lambda *args, **kwargs: None

    def exit(self) -> None:
        import plyx.attn._attention as attention

        for impl in self.impls:
            self.registry.unregister(impl.name, impl.impl)
        if self._stacked is not None:
            attention.stacked_for_training = self._stacked

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.model(ids, position_ids=self.positions[: ids.shape[1]], return_hidden=True)  # (B, T, D)
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B T, D)
        weight = self.model.lm_head_weight
        lce = self.registry.get("linear_cross_entropy", flat, weight, targets)
        return lce(flat, weight, targets.reshape(-1), ignore_index=-100, reduction="mean")


def _step(loss_fn: Any, opt: torch.optim.Optimizer, params: list[torch.Tensor], ids: torch.Tensor,
          targets: torch.Tensor, clip: float) -> None:
    loss = loss_fn(ids, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def recipe_setup(allocator: str) -> tuple[str, Any]:
    """``(allocator in force, the shipped shakespeare-char TrainConfig)``: ``allocator`` "plyx" applies the setting
    ``plyx train`` applies on CPU (``plyx.train._cpu_alloc``), "glibc" keeps glibc's defaults."""
    in_force = "glibc"
    if allocator == "plyx":
        from plyx.train._cpu_alloc import tune_cpu_allocator

        in_force = "plyx" if tune_cpu_allocator() else "glibc (plyx's setting not applicable here)"
    from plyx.specs import TrainConfig, load_config
    from plyx.train._cli import shipped_configs

    return in_force, load_config(TrainConfig, shipped_configs()["shakespeare-char"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--chunk", type=int, default=20, help="iterations of one side before switching")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations of each side first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--label", default="", help="recorded with the result (e.g. the commit)")
    p.add_argument("--allocator", choices=("plyx", "glibc"), default="plyx",
                   help="plyx: the allocator setting `plyx train` applies on CPU (plyx.train._cpu_alloc), in force for "
                        "all sides (one process); glibc: its defaults, as before plyx-train 1.x")
    p.add_argument("--baseline", default="", metavar="REF",
                   help="also time plyx with the reference kernels of git commit REF (before/after in one run)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator, config = recipe_setup(args.allocator)
    B, T = config.batch_size, config.model.max_seq_len
    sides = _sides(config)
    baseline = Baseline(args.baseline, config) if args.baseline else None
    switch: dict[str, Any] = {}
    if baseline is not None:
        sides[f"plyx@{args.baseline}"] = (baseline.loss, baseline.optimizer, list(baseline.model.parameters()))
        switch[f"plyx@{args.baseline}"] = baseline
    gen = torch.Generator().manual_seed(0)
    # the same batches for both sides: random character ids (the step's cost does not depend on the text)
    windows = [torch.randint(0, 65, (B, T + 1), generator=gen) for _ in range(args.chunk)]
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]  # (ids, targets), as get_batch
    clip = config.optimizer.grad_clip
    wall: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    per_round: list[float] = []
    per_round_baseline: list[float] = []
    for name, (fn, opt, params) in sides.items():
        if name in switch:
            switch[name].enter()
        for i in range(args.warmup):
            ids, targets = batches[i % len(batches)]
            _step(fn, opt, params, ids, targets, clip)
        if name in switch:
            switch[name].exit()
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]  # alternate who goes first
        medians = {}
        for name in order:
            fn, opt, params = sides[name]
            if name in switch:
                switch[name].enter()
            times = []
            for ids, targets in batches:
                t0, c0 = time.perf_counter(), time.process_time()
                _step(fn, opt, params, ids, targets, clip)
                times.append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            if name in switch:
                switch[name].exit()
            wall[name] += times
            medians[name] = statistics.median(times)
        per_round.append(medians["plyx"] / medians["nanogpt"])
        for name in switch:
            per_round_baseline.append(medians[name] / medians["nanogpt"])
    date = datetime.date.today().isoformat()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    row = {
        "date": date, "device": "cpu", "machine": platform.machine(), "torch": torch.__version__,
        "threads": args.threads, "allocator": allocator, "load_average": load, "label": args.label, "batch": B, "seq_len": T,
        "params": {s: sum(p.numel() for p in v[2]) for s, v in sides.items()},
        "ms_per_iter_median": {s: 1e3 * statistics.median(v) for s, v in wall.items()},
        "cpu_ms_per_iter_median": {s: 1e3 * statistics.median(v) for s, v in cpu.items()},
        "ratio_wall_median": statistics.median(wall["plyx"]) / statistics.median(wall["nanogpt"]),
        "ratio_cpu_median": statistics.median(cpu["plyx"]) / statistics.median(cpu["nanogpt"]),
        "ratio_per_round_median": statistics.median(per_round),
        "ratio_per_round_min": min(per_round), "ratio_per_round_max": max(per_round),
        "rounds": args.rounds, "chunk": args.chunk,
    }
    if baseline is not None:
        b = f"plyx@{args.baseline}"
        row["baseline"] = {"ref": args.baseline, "kernels": list(BASELINE_KERNELS),
                           "ratio_wall_median": statistics.median(wall[b]) / statistics.median(wall["nanogpt"]),
                           "ratio_cpu_median": statistics.median(cpu[b]) / statistics.median(cpu["nanogpt"]),
                           "ratio_per_round_median": statistics.median(per_round_baseline)}
    print(f"cpu ({platform.machine()}), torch {torch.__version__}, {args.threads} threads, allocator {allocator}, {date}, "
          f"load {load}")
    for s in sides:
        print(f"{s:>16}: {row['ms_per_iter_median'][s]:7.2f} ms/iter wall, {row['cpu_ms_per_iter_median'][s]:7.2f} "
              f"CPU ms/iter, {row['params'][s]:,} params")
    print(f"plyx / nanoGPT: {row['ratio_wall_median']:.3f} wall, {row['ratio_cpu_median']:.3f} CPU, "
          f"{row['ratio_per_round_median']:.3f} median of {args.rounds} paired rounds "
          f"({row['ratio_per_round_min']:.3f}-{row['ratio_per_round_max']:.3f})")
    if baseline is not None:
        b = row["baseline"]
        print(f"plyx@{args.baseline} / nanoGPT: {b['ratio_wall_median']:.3f} wall, {b['ratio_cpu_median']:.3f} CPU, "
              f"{b['ratio_per_round_median']:.3f} median of {args.rounds} paired rounds")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"step-vs-nanogpt-cpu-{date}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
