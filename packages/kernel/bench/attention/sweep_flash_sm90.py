"""Autotune-free sweep of the flash-attention variants against torch SDPA's cuDNN and flash backends.

Every ``VARIANTS`` entry of ``plyx.kernel.attention._flash`` (the plain kernel, TMA loads, warp-specialised
loops, a persistent forward, larger tiles, the single-pass atomic-dQ backward, ...) is timed with its fixed
launch configuration, forward and forward+backward, bf16, [B, T, H, Dh] with B x T = ``--tokens`` (16,384: 2,048
blocks of 128 queries at 16 heads, every SM busy at every length), causal and full, beside
``F.scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` and ``(FLASH_ATTENTION)``. Prints
TFLOP/s and the ratio to each backend, checks each variant's output and gradients against cuDNN at the first
length, and writes everything (rewritten after every variant, so an interrupted run keeps what it measured)
to ``--out`` (default: ``packages/kernel/bench/results/sweep-flash-sm90-<device>-<date>.json``). The last
lines name the best forward and the best backward variant per (head_dim, causal): the entry to put in
``_flash.BEST``. FLOPs: forward 4 B H T^2 Dh (halved when causal), forward+backward 3.5x that.

``--budget-s`` stops starting new variants past that many seconds (compiling is most of the time), so one
call stays inside a device slot; the variants left out are listed, for a second call with ``--variants``.
Without CUDA it runs the kernels in Triton's interpreter at a tiny size (``--tiny``, the CPU proof), timed
with perf_counter beside SDPA's CPU backend: those figures say nothing about a GPU.

GPU (one H100, ~3 minutes)::

    python packages/kernel/bench/attention/sweep_flash_sm90.py --out $OUT/sweep-flash-sm90.json
    python packages/kernel/bench/attention/sweep_flash_sm90.py --head-dims 64 --out $OUT/sweep-flash-sm90-d64.json

CPU::

    python packages/kernel/bench/attention/sweep_flash_sm90.py --tiny --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import torch.nn.functional as F
import triton
from plyx.kernel.attention._flash import VARIANTS, flash_attention, use_config
from torch.nn.attention import SDPBackend, sdpa_kernel

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _flops(B: int, T: int, H: int, D: int, causal: bool) -> float:
    return 4.0 * B * H * T * T * D / (2 if causal else 1)


def _timer(cuda: bool, rep_ms: int) -> Callable[..., float]:
    """Milliseconds per call: ``triton.testing.do_bench`` medians on CUDA, perf_counter medians on CPU."""
    if cuda:
        def gpu(fn, grads=None):
            return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, grad_to_none=grads, return_mode="median")
        return gpu

    def cpu(fn, grads=None):
        times = []
        for _ in range(3):
            if grads:
                for g in grads:
                    g.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return cpu


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


class Case:
    """The inputs of one (head_dim, causal, T): plyx's [B, T, H, Dh] and SDPA's [B, H, T, Dh] copies."""

    def __init__(self, D: int, H: int, T: int, tokens: int, causal: bool, device: str) -> None:
        self.D, self.H, self.T, self.causal = D, H, T, causal
        self.B = max(tokens // T, 1)
        g = torch.Generator(device=device).manual_seed(T * 131 + D)
        shape = (self.B, T, H, D)
        self.q, self.k, self.v, self.do = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
                                           for _ in range(4))
        self.flops = _flops(self.B, T, H, D, causal)
        self.sdpa = tuple(x.transpose(1, 2).contiguous() for x in (self.q, self.k, self.v, self.do))


def _time_plyx(case: Case, time_ms) -> dict[str, float]:
    q, k, v, do = case.q, case.k, case.v, case.do
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    f = time_ms(lambda: flash_attention(q, k, v, causal=case.causal))
    fb = time_ms(lambda: flash_attention(qg, kg, vg, causal=case.causal).backward(do), grads=[qg, kg, vg])
    return {"fwd_ms": f, "fwd_bwd_ms": fb, "bwd_ms": fb - f, "fwd_tflops": case.flops / f / 1e9,
            "fwd_bwd_tflops": 3.5 * case.flops / fb / 1e9}


def _time_sdpa(case: Case, backend: SDPBackend, time_ms) -> dict[str, Any]:
    qt, kt, vt, dot = case.sdpa
    try:
        with sdpa_kernel(backend):
            f = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=case.causal))
            qs, ks, vs = (x.clone().requires_grad_() for x in (qt, kt, vt))
            fb = time_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal).backward(dot),
                         grads=[qs, ks, vs])
    except RuntimeError as exc:  # a backend that refuses this shape or device
        return {"error": str(exc).splitlines()[0][:200]}
    return {"fwd_ms": f, "fwd_bwd_ms": fb, "bwd_ms": fb - f, "fwd_tflops": case.flops / f / 1e9,
            "fwd_bwd_tflops": 3.5 * case.flops / fb / 1e9}


def _reference_grads(case: Case, backend: SDPBackend) -> tuple[torch.Tensor, ...] | None:
    qt, kt, vt, dot = case.sdpa
    qs, ks, vs = (x.clone().requires_grad_() for x in (qt, kt, vt))
    try:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal)
            o.backward(dot)
    except RuntimeError:
        return None
    # back to [B, T, H, Dh]
    return tuple(x.transpose(1, 2) for x in (o, qs.grad, ks.grad, vs.grad))


def _errors(case: Case, ref: tuple[torch.Tensor, ...]) -> dict[str, float]:
    qg, kg, vg = (x.clone().requires_grad_() for x in (case.q, case.k, case.v))
    o = flash_attention(qg, kg, vg, causal=case.causal)
    o.backward(case.do)
    return {name: _rel(got, want) for name, got, want in zip(("o", "dq", "dk", "dv"), (o, qg.grad, kg.grad, vg.grad),
                                                                ref)}


def _winners(rows: list[dict[str, Any]], ref_name: str) -> dict[str, dict[str, Any]]:
    """Per (head_dim, causal): the variant with the best mean forward ratio to ``ref_name`` over the lengths,
    and the one with the best mean backward (forward+backward minus forward) ratio, among correct ones."""
    out: dict[str, dict[str, Any]] = {}
    keys = sorted({(r["head_dim"], r["causal"]) for r in rows})
    for d, causal in keys:
        per: dict[str, dict[str, list[float]]] = {}
        for r in rows:
            if (r["head_dim"], r["causal"]) != (d, causal) or r.get("wrong") or ref_name not in r["ref_ms"]:
                continue
            ref = r["ref_ms"][ref_name]
            p = per.setdefault(r["variant"], {"fwd": [], "bwd": [], "fwd_bwd": []})
            p["fwd"].append(ref["fwd_ms"] / r["fwd_ms"])
            p["bwd"].append(ref["bwd_ms"] / r["bwd_ms"])
            p["fwd_bwd"].append(ref["fwd_bwd_ms"] / r["fwd_bwd_ms"])
        if not per:
            continue
        mean = {v: {k: statistics.fmean(x) for k, x in p.items()} for v, p in per.items()}
        fwd = max(mean, key=lambda v: mean[v]["fwd"])
        bwd = max(mean, key=lambda v: mean[v]["bwd"])
        out[f"{d},{causal}"] = {"head_dim": d, "causal": causal, "fwd": fwd, "bwd": bwd,
                                f"fwd_vs_{ref_name}": round(mean[fwd]["fwd"], 3),
                                f"bwd_vs_{ref_name}": round(mean[bwd]["bwd"], 3),
                                "mean_ratios": {v: {k: round(x, 3) for k, x in m.items()} for v, m in mean.items()}}
    return out


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)  # atomic: an interrupted run never leaves half a file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # warp-specialised variants only when named: Triton 3.6 and 3.9 compile them to the same sm_90 PTX as
    # without (nothing to time), and a build that cannot lower them may abort the process (an LLVM fatal
    # error, not an exception); name them last, the file written after each variant keeps everything before
    plain = [v for v in VARIANTS if not VARIANTS[v].warp_specialize]
    parser.add_argument("--variants", nargs="+", default=plain, choices=list(VARIANTS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="B x T per case")
    parser.add_argument("--heads", type=int, help="query heads (default: 16 at Dh 128, 32 below)")
    parser.add_argument("--rep-ms", type=int, default=60, help="do_bench's measuring time per figure")
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no variant after this many seconds")
    parser.add_argument("--tiny", action="store_true", help="CPU proof: T 64 and 48, 64 tokens, 2 heads")
    parser.add_argument("--out", type=Path, help="JSON path (default under packages/kernel/bench/results/)")
    a = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        parser.error("no CUDA: pass --tiny (the interpreter's CPU proof at a tiny size)")
    if a.tiny:
        a.seq_lens, a.tokens, a.heads = [64, 48], 64, 2
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)"
    slug = re.sub("[^a-z0-9]+", "-", name.lower()).strip("-")
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = a.out or RESULTS / f"sweep-flash-sm90-{slug}-{today}.json"
    refs = ({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION} if cuda
            else {"math": SDPBackend.MATH})
    first_ref = next(iter(refs))
    time_ms = _timer(cuda, a.rep_ms)
    causals = {"both": [True, False], "true": [True], "false": [False]}[a.causal]
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, {today}; ratios = reference time / "
          f"plyx time (> 1: plyx faster)", flush=True)

    cases = [Case(d, a.heads or (16 if d >= 128 else 32), t, a.tokens, c, device)
             for d in a.head_dims for c in causals for t in a.seq_lens]
    result: dict[str, Any] = {
        "device": name, "date": today, "torch": torch.__version__, "triton": triton.__version__,
        "dtype": "bfloat16", "tokens": a.tokens, "seq_lens": a.seq_lens, "head_dims": a.head_dims,
        "flops": "forward 4 B H T^2 Dh (/2 causal); forward+backward 3.5x", "references": {}, "rows": [],
        "failed": {}, "not_run": [], "configs": {}, "winners": {},
    }
    for case in cases:  # the references once per case
        key = f"d{case.D} causal={case.causal} T={case.T}"
        result["references"][key] = {r: _time_sdpa(case, b, time_ms) for r, b in refs.items()}
        cells = " | ".join(f"{r} fwd {m.get('fwd_tflops', float('nan')):6.1f} fwd+bwd "
                           f"{m.get('fwd_bwd_tflops', float('nan')):6.1f} TFLOP/s"
                           for r, m in result["references"][key].items())
        print(f"{key:26s} {cells}", flush=True)
    grads = {id(c): _reference_grads(c, refs[first_ref]) for c in cases if c.T == a.seq_lens[0]}

    t_start = time.time()
    try:
        for variant in a.variants:
            if time.time() - t_start > a.budget_s:
                result["not_run"].append(variant)
                continue
            cfg = VARIANTS[variant]
            result["configs"][variant] = {k: (list(v) if isinstance(v, tuple) else v)
                                          for k, v in cfg.__dict__.items()}
            t0 = time.time()
            with use_config(variant):
                for case in cases:
                    key = f"d{case.D} causal={case.causal} T={case.T}"
                    try:
                        row: dict[str, Any] = {"variant": variant, "head_dim": case.D, "causal": case.causal,
                                               "T": case.T, "B": case.B, "H": case.H, **_time_plyx(case, time_ms)}
                        if grads.get(id(case)) is not None:
                            row["rel_err"] = _errors(case, grads[id(case)])
                            row["wrong"] = max(row["rel_err"].values()) > 0.05
                    except Exception as exc:  # a variant this Triton cannot compile or run: reported, the rest go on
                        result["failed"][f"{variant} {key}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                        print(f"{variant:15s} {key:26s} FAILED: {result['failed'][f'{variant} {key}']}", flush=True)
                        continue
                    row["ref_ms"] = {r: m for r, m in result["references"][key].items() if "error" not in m}
                    ratios = {r: (m["fwd_ms"] / row["fwd_ms"], m["fwd_bwd_ms"] / row["fwd_bwd_ms"])
                              for r, m in row["ref_ms"].items()}
                    row["ratios"] = {r: {"fwd": round(f, 3), "fwd_bwd": round(fb, 3)} for r, (f, fb) in ratios.items()}
                    result["rows"].append(row)
                    cells = "  ".join(f"/{r} {f:4.2f} {fb:4.2f}" for r, (f, fb) in ratios.items())
                    err = f"  err {max(row['rel_err'].values()):.1e}" if "rel_err" in row else ""
                    print(f"{variant:15s} {key:26s} fwd {row['fwd_tflops']:6.1f} fwd+bwd {row['fwd_bwd_tflops']:6.1f} "
                          f"TFLOP/s ({row['fwd_ms']:.3g} / {row['fwd_bwd_ms']:.3g} ms)  {cells}{err}"
                          f"{'  WRONG' if row.get('wrong') else ''}", flush=True)
            result["configs"][variant]["seconds"] = round(time.time() - t0, 1)
            result["winners"] = _winners(result["rows"], first_ref)
            _write(out, result)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    result["winners"] = _winners(result["rows"], first_ref)
    _write(out, result)
    for w in result["winners"].values():
        print(f"best at Dh {w['head_dim']} causal={w['causal']}: forward {w['fwd']} "
              f"({w[f'fwd_vs_{first_ref}']:.3f}x {first_ref}), backward {w['bwd']} "
              f"({w[f'bwd_vs_{first_ref}']:.3f}x {first_ref})  ->  BEST[({w['head_dim']}, {w['causal']})] = "
              f"({w['fwd']!r}, {w['bwd']!r})")
    if result["not_run"]:
        print(f"not run (budget): {' '.join(result['not_run'])}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
