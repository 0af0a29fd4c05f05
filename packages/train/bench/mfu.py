"""Tokens/s and MFU of plyx-train's step against a plain PyTorch loop, eager and compiled, in one run.

The variants, on the same shape, data and device, one after the other (each builds its own model and
optimizer, frees them, and resets the peak-memory counter):

- ``plyx-eager``: plyx-train's step: ``TransformerLM`` + ``lm_loss`` (the registry's kernels: Triton
  RMSNorm, SwiGLU, RoPE, fused linear cross-entropy; attention by ``TrainConfig.attention = "auto"``:
  torch SDPA on sm90+, the Triton flash kernel below) under bf16 autocast, gradient clipping,
  ``build_optimizer`` (fused AdamW), as ``Trainer.fit`` runs it, without the data loader;
- ``plyx-eager-triton``: the same with ``attention = "triton"`` (the Triton flash kernel for every call);
- ``plyx-compiled``: ``torch.compile(model)`` (``compile = true``) with the defaults ``attention = "auto"``,
  ``compiled_norms = "auto"``: SDPA traced by Dynamo where chosen, RMSNorm as torch ops Inductor fuses
  with the residual adds, the other kernels ``plyx::`` custom ops;
- ``plyx-compiled-sdpa`` / ``plyx-compiled-triton``: the same with ``attention = "sdpa"`` / ``"triton"``;
- ``plyx-compiled-kernel-norms``: ``compiled_norms = "kernel"`` (RMSNorm as the ``plyx::rmsnorm`` custom op);
- ``plyx-compiled-triton-kernel-norms``: both custom ops, as ``compile = true`` ran before plyx-train 1.7
  (the H100 run of 2026-11-24: 42.9% MFU);
- ``torch-eager``: a plain HF-style Llama written here (``nn.Linear``, RMSNorm in torch ops, RoPE,
  ``F.scaled_dot_product_attention`` with GQA, full ``[B T, V]`` logits + ``F.cross_entropy``), same
  autocast, clipping and fused ``torch.optim.AdamW``;
- ``torch-compiled``: that loop with ``torch.compile(model)``.

Each plyx variant prints the kernel choice in force (``plyx.kernel.training_kernels``) and, eager, how many
attention calls took SDPA and the Triton kernel.

MFU = tokens/s x FLOPs per token / peak, FLOPs per token by ``TransformerLM.flops_per_token`` (6 N + 12 L H
Dh T, PaLM appendix B) for every variant; the peak from the device name (H100 and H200: 989 TFLOP/s bf16
dense; ``--peak-flops`` overrides). Each variant also records its measured peak memory beside
plyx-train's pre-flight plan (``plan_memory``) for the same run.

Run on one GPU (about 5 minutes for the default variants, most of it the compilations, ~35 s each)::

    python packages/train/bench/mfu.py --steps 20 --warmup 3 --out packages/train/bench/results

CPU proof of the script (a tiny shape, no MFU): ``python packages/train/bench/mfu.py --tiny``.
``--profile`` also writes each variant's kernel table (3 profiled steps) to ``<out>/profile-<variant>.txt``.
Results are appended as JSON lines to ``<out>/mfu-<device>-<date>.jsonl`` and printed as a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the issue's 1.0B Llama shape (d 2048, 22 layers, GQA 32/4, ffn 5632, vocab 8192, seq 2048)
SHAPES = {
    "1b": {"d_model": 2048, "n_layers": 22, "n_heads": 32, "n_kv_heads": 4, "d_ff": 5632, "vocab_size": 8192,
           "seq_len": 2048, "batch": 4},
    "gpt2-124m": {"d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "d_ff": 2048, "vocab_size": 50304,
                  "seq_len": 1024, "batch": 16},
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 160, "vocab_size": 256,
             "seq_len": 64, "batch": 2},
}
#: plyx variant -> (compiled, TrainConfig.attention, TrainConfig.compiled_norms)
PLYX_VARIANTS = {
    "plyx-eager": (False, "auto", "auto"),
    "plyx-eager-triton": (False, "triton", "auto"),
    "plyx-compiled": (True, "auto", "auto"),
    "plyx-compiled-sdpa": (True, "sdpa", "auto"),
    "plyx-compiled-triton": (True, "triton", "auto"),
    "plyx-compiled-kernel-norms": (True, "auto", "kernel"),
    "plyx-compiled-triton-kernel-norms": (True, "triton", "kernel"),
}
VARIANTS = (*PLYX_VARIANTS, "torch-eager", "torch-compiled")
#: what runs without --variants: everything but torch-eager (the compiled plain loop is the bar)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "torch-eager")
_W = max(map(len, VARIANTS))  # the printed table's name column
PEAKS = {"H100": 989e12, "H200": 989e12}  # bf16 dense tensor-core peak (SXM)


# -- the plain PyTorch baseline: an HF-style Llama, nothing fused ----------------------------------

class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Block(nn.Module):
    def __init__(self, d: int, h: int, kv: int, f: int) -> None:
        super().__init__()
        self.h, self.kv, self.dh = h, kv, d // h
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(d), _RMSNorm(d)
        self.q_proj = nn.Linear(d, h * self.dh, bias=False)
        self.k_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.o_proj = nn.Linear(h * self.dh, d, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, T, self.h, self.dh).transpose(1, 2)  # (B, H, T, Dh)
        k = self.k_proj(y).view(B, T, self.kv, self.dh).transpose(1, 2)  # (B, KV, T, Dh)
        v = self.v_proj(y).view(B, T, self.kv, self.dh).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, Dh)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class PlainLlama(nn.Module):
    """The baseline: what a PyTorch user writes (transformers' modeling_llama, SDPA attention)."""

    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        d, h = s["d_model"], s["n_heads"]
        self.embed_tokens = nn.Embedding(s["vocab_size"], d)
        self.layers = nn.ModuleList(_Block(d, h, s["n_kv_heads"], s["d_ff"]) for _ in range(s["n_layers"]))
        self.norm = _RMSNorm(d)
        self.lm_head = nn.Linear(d, s["vocab_size"], bias=False)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d // h, 2).float() / (d // h)))
        angles = torch.outer(torch.arange(s["seq_len"]).float(), inv)  # (T, Dh/2)
        emb = torch.cat((angles, angles), dim=-1)  # (T, Dh)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x)).float()  # (B, T, V): the full logits, as HF computes them
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# -- the variants ----------------------------------------------------------------------------------

def _plyx(shape: dict[str, int], device: torch.device, compiled: bool) -> tuple[Any, Any, nn.Module]:
    """The plyx step's model, optimizer and loss (the kernel choice is the caller's ``training_kernels`` block)."""
    from plyx.model import TransformerLM
    from plyx.specs import Batch, OptimizerConfig
    from plyx.train import lm_loss
    from plyx.train._optim import build_optimizer

    module = TransformerLM(_model_config(shape), device=device)
    model = torch.compile(module) if compiled else module
    optimizer = build_optimizer(module, OptimizerConfig(lr=3e-4, weight_decay=0.1, grad_clip=1.0))

    def loss_fn(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(model, Batch(input_ids=ids, targets=targets))

    return loss_fn, optimizer, module


def _torch(shape: dict[str, int], device: torch.device, compiled: bool) -> tuple[Any, Any, nn.Module]:
    module = PlainLlama(shape).to(device)
    model = torch.compile(module) if compiled else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    return model, optimizer, module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name: str, shape: dict[str, int], device: torch.device, steps: int, warmup: int,
                profile: Path | None = None) -> dict[str, Any]:
    """Time ``steps`` steps after ``warmup`` (compilation included there); returns the measurements.

    With ``profile`` (a directory), 3 more steps run under ``torch.profiler`` afterwards and their kernel table
    (self device time, top 40) is written to ``profile/profile-<variant>.txt``: where the step's time goes.
    """
    torch.manual_seed(0)
    plyx = name in PLYX_VARIANTS
    compiled, attention, norms = PLYX_VARIANTS[name] if plyx else (name.endswith("compiled"), "", "")
    gc.collect()  # the previous variant's model and optimizer
    torch._dynamo.reset()  # each compiled variant traces afresh under its own choices
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.ExitStack() as scope:
        kernels = None
        if plyx:
            from plyx.kernel import training_kernels

            kernels = scope.enter_context(training_kernels(attention, norms, device=device, dtype=torch.bfloat16))
            print(f"{name:>{_W}}: {kernels.describe(compiled=compiled)}", flush=True)
        out = _measure(name, shape, device, steps, warmup, profile, plyx, compiled)
    if kernels is not None:
        out["kernels"] = {"attention": attention, "compiled_norms": norms, "registry_attention": kernels.attention,
                          "compiled_attention": kernels.compiled_attention,
                          "compiled_norms_resolved": kernels.compiled_norms}
    return out


def _measure(name: str, shape: dict[str, int], device: torch.device, steps: int, warmup: int, profile: Path | None,
             plyx: bool, compiled: bool) -> dict[str, Any]:
    """Build the variant's model and optimizer, time its steps, profile them (``profile``); the measurements."""
    from plyx.kernel.attention._hybrid import ROUTES

    build = _plyx if plyx else _torch
    loss_fn, optimizer, module = build(shape, device, compiled)
    routes = dict(ROUTES)
    params = [p for p in module.parameters() if p.requires_grad]
    B, T, V = shape["batch"], shape["seq_len"], shape["vocab_size"]
    ids = torch.randint(0, V, (B, T), device=device)
    targets = torch.roll(ids, -1, 1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    losses: list[torch.Tensor] = []

    def step() -> None:
        with autocast:
            loss = loss_fn(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read back after the timing: no host sync inside the step

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm_s = time.perf_counter() - t0
    runs = _op_forward_runs()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    dt = (time.perf_counter() - t0) / steps
    # plyx:: custom ops (compiled variants): implementation forwards per step, recomputes in backwards included
    op_runs = {k: (v - runs.get(k, 0)) / steps for k, v in _op_forward_runs().items() if v != runs.get(k, 0)}
    # the hybrid attention's eager calls per step, each side (compiled graphs apply the rule once, when traced)
    routed = {k: (v - routes.get(k, 0)) / (steps + warmup) for k, v in ROUTES.items() if v != routes.get(k, 0)}
    if profile is not None:
        _profile(step, name, device, profile)
    flops = _flops_per_token(shape)
    out = {
        "variant": name, "ms_per_step": dt * 1e3, "tokens_per_s": B * T / dt, "flops_per_token": flops,
        "warmup_s": warm_s, "final_loss": float(losses[-1]), "params": sum(p.numel() for p in params),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "op_forward_runs_per_step": op_runs, "attention_calls_per_step": routed,
    }
    if plyx:
        out["planned_gib"] = _planned(shape, out["params"], device) / 2**30
    return out  # the model, optimizer and step closure are freed with this frame (collected by the next variant)


def _op_forward_runs() -> dict[str, int]:
    """``plyx.kernel._saving.FORWARD_RUNS`` (plyx-kernel >= 1.5), or nothing on an older plyx-kernel."""
    try:
        from plyx.kernel._saving import FORWARD_RUNS
    except ImportError:
        return {}
    return dict(FORWARD_RUNS)


def _profile(step: Any, name: str, device: torch.device, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile-{name}.txt"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{name}: 3 steps, sorted by {key}\n" + prof.key_averages().table(sort_by=key, row_limit=40,
                                                                                   max_name_column_width=90))
    tmp.replace(path)
    print(f"{name:>{_W}}: profile written to {path}", flush=True)


def _model_config(shape: dict[str, int]) -> Any:
    from plyx.specs.config.model import ModelConfig

    return ModelConfig(vocab_size=shape["vocab_size"], d_model=shape["d_model"], n_layers=shape["n_layers"],
                       n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"], d_ff=shape["d_ff"],
                       max_seq_len=shape["seq_len"])


def _flops_per_token(shape: dict[str, int]) -> float:
    """``TransformerLM.flops_per_token`` of the shape (a model on the meta device: no memory)."""
    from plyx.model import TransformerLM

    return float(TransformerLM(_model_config(shape), device="meta").flops_per_token(shape["seq_len"]))


def _planned(shape: dict[str, int], params: int, device: torch.device) -> int:
    from plyx.specs import DataConfig, TrainConfig
    from plyx.train import plan_memory

    config = TrainConfig(model=_model_config(shape), data=DataConfig(path=".", seq_len=shape["seq_len"]), batch_size=shape["batch"],
                         precision="bf16-autocast")
    return plan_memory(config, params, device_type=device.type).total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--tiny", action="store_true", help="the tiny shape on CPU in seconds: proves the script")
    p.add_argument("--batch", type=int, help="micro-batch (default: the shape's)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all but torch-eager)")
    p.add_argument("--peak-flops", type=float, help="override the device's peak FLOP/s")
    p.add_argument("--out", type=Path, help="append results to OUT/mfu-<device>-<date>.jsonl")
    p.add_argument("--profile", action="store_true",
                   help="also profile 3 steps per variant: OUT/profile-<variant>.txt (needs --out)")
    args = p.parse_args(argv)
    if args.profile and not args.out:
        p.error("--profile writes its tables under --out DIR: pass --out")
    shape = dict(SHAPES["tiny" if args.tiny else args.shape])
    if args.batch:
        shape["batch"] = args.batch
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_flops or next((v for k, v in PEAKS.items() if k in name), None)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    date = datetime.date.today().isoformat()
    torch._dynamo.config.verbose = True  # a failed compile reports Dynamo's internal stack too (TORCHDYNAMO_VERBOSE)
    print(f"{name}, torch {torch.__version__}, {date}: shape {args.shape if not args.tiny else 'tiny'} {shape}")
    rows = []
    failed = []
    for v in variants:
        if device.type != "cuda" and v in PLYX_VARIANTS and PLYX_VARIANTS[v][1] == "triton":
            print(f"{v:>{_W}}: skipped (the Triton flash kernel runs on CUDA only)", flush=True)
            continue
        try:
            r = run_variant(v, shape, device, args.steps, args.warmup, args.out if args.profile else None)
        except Exception as exc:  # one variant's failure (a compile crash) is reported whole; the others still run
            # the full traceback, chained causes included, on stdout (the log) and stderr: the H100 log of
            # 2026-11-24 kept only the last lines of Dynamo's warnings, not the exception that stopped the run
            text = "".join(traceback.format_exception(exc))
            print(f"{v:>{_W}}: FAILED ({type(exc).__name__})\n{text}", flush=True)
            print(f"{v}: FAILED\n{text}", file=sys.stderr, flush=True)
            failed.append(v)
            rows.append({"variant": v, "error": f"{type(exc).__name__}: {exc}"[:2000], "device": name, "date": date,
                         "torch": torch.__version__, "shape": args.shape if not args.tiny else "tiny"})
            gc.collect()
            continue
        r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak if peak else None
        r.update(device=name, date=date, torch=torch.__version__, shape=args.shape if not args.tiny else "tiny", **{
            f"shape_{k}": val for k, val in shape.items()})
        rows.append(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "-"
        plan = f" (plan {r['planned_gib']:.1f})" if "planned_gib" in r else ""
        print(f"{v:>{_W}}: {r['ms_per_step']:9.2f} ms/step {r['tokens_per_s']:12,.0f} tok/s  MFU {mfu:>6}  "
              f"peak {mem}{plan}  warmup {r['warmup_s']:.1f} s  loss {r['final_loss']:.4f}", flush=True)
        if r["op_forward_runs_per_step"]:
            print(f"{'':>{_W}}  plyx:: op forwards per step: {r['op_forward_runs_per_step']}", flush=True)
        if r["attention_calls_per_step"]:
            print(f"{'':>{_W}}  eager attention calls per step: {r['attention_calls_per_step']}", flush=True)
        if not math.isfinite(r["final_loss"]):
            print(f"{v}: non-finite loss", file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = name.replace(" ", "-").lower()
        path = args.out / f"mfu-{slug}-{date}.jsonl"
        with path.open("a") as f:  # appended: one line per variant, earlier runs kept
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"appended {len(rows)} rows to {path}")
    if failed:
        print(f"failed variants: {', '.join(failed)} (tracebacks above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
