"""Tile sweep of the batch-1 decode GEMVs (1.1B shapes) against cuBLAS, timed as a decode step runs them.

Each timing is one CUDA graph over 22 distinct weight matrices (one per layer, so the weights stream
from HBM instead of sitting in L2), replayed 20 times, best of 3, in microseconds per matrix. Three
kernels are swept over ``(BLOCK_N, BLOCK_K, num_warps, stages)``:

    gemv            y = x @ W.T (plyx-kernel's Triton GEMV) on every shape
    rmsnorm_linear  the q/k/v and gate/up shapes, norm and residual fused
    swiglu_linear   the down projection

Programmatic dependent launch is on (Hopper) unless ``PLYX_TRITON_PDL=0``: then each kernel waits for the
one before it, as a kernel after cuBLAS does. ``--tma`` times a GEMV whose weight tiles come through
Hopper's tensor memory accelerator instead (measured slower: results file).

    python packages/kernel/bench/sweep_gemv.py [--quick] [--shapes down,o] [--tma] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from plyx.kernel.triton_ops._common import PDL_ENABLED

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rmsnorm_linear import graph_time

HIDDEN, FFN, LAYERS, DTYPE = 2048, 5632, 22, torch.bfloat16
SHAPES = {"qkv": (2560, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}


@triton.jit
def _gemv_tma_kernel(X, w_desc, Y, M, N, K, sxm, sym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    """The same GEMV with the weight tiles brought in by the tensor memory accelerator (Hopper's TMA)."""
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & (rn < N)[None, :])


def gemv_tma(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int, int, int], pdl: bool = True) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = blocks
    desc = TensorDescriptor.from_tensor(w, block_shape=[bn, bk])
    _gemv_tma_kernel[(triton.cdiv(n, bn),)](x, desc, y, m, n, k, x.stride(0), y.stride(0),
                                            BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
                                            STAGES=stages, USE_GDC=pdl, num_warps=warps, launch_pdl=pdl)
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int, int, int]) -> torch.Tensor:
    """plyx-kernel's Triton ``gemv`` with forced tiles (programmatic dependent launch unless PLYX_TRITON_PDL=0)."""
    from plyx.kernel.triton_ops.gemv import gemv as triton_gemv

    return triton_gemv(x, w, blocks=blocks)


def _weights(n: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(DTYPE) for _ in range(LAYERS)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12))


def _time(name: str, fn: Callable[[int], object], check: Callable[[], float] | None, nbytes: int,
          rows: list[dict], **info: object) -> float:
    try:
        if check is not None and check() > 2e-2:
            print(f"  {name} {info}: wrong output, skipped")
            return float("inf")
        us = graph_time(fn, LAYERS)
    except Exception as e:  # e.g. OutOfResources for the widest tiles
        print(f"  {name} {info}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
        return float("inf")
    rows.append({"kernel": name, "us": round(us, 3), "GBps": round(nbytes / us / 1e3), **info})
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer candidates")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--tma", action="store_true", help="only the TMA GEMV candidates (Hopper)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to time")
        return 0
    from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear
    from plyx.kernel.triton_ops.swiglu_linear import swiglu_linear

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"decode GEMV sweep | {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {date}")
    bns = (2, 4, 8, 16) if args.quick else (1, 2, 4, 8, 16, 32)
    bks = (512, 1024, 2048)
    warps = (4, 8) if args.quick else (2, 4, 8)
    stages = (3,) if args.quick else (2, 4)
    swiglu_stages = (3, 4) if args.quick else (2, 3, 4)
    rows: list[dict] = []
    torch.inference_mode().__enter__()
    x = torch.randn(1, FFN * 2, device="cuda").to(DTYPE)
    if args.tma:
        _sweep_tma(x, rows)
        _write(args.out, rows, date)
        return 0
    for shape, (n, k) in SHAPES.items():
        if shape not in args.shapes.split(","):
            continue
        ws = _weights(n, k)
        xs = x[:, :k]
        nbytes = n * k * DTYPE.itemsize
        cublas = _time("cublas", lambda i, xs=xs, ws=ws: torch.nn.functional.linear(xs, ws[i]), None, nbytes, rows, shape=shape)
        print(f"{shape} [{n}x{k}] cuBLAS {cublas:.2f} us ({nbytes / cublas / 1e3:.0f} GB/s)")
        best = (float("inf"), None)
        for bn, bk, wp, st in itertools.product(bns, bks, warps, stages):
            if bk > triton.next_power_of_2(k) or (st != stages[0] and bk >= k):
                continue
            blocks = (bn, bk, wp, st)
            us = _time("gemv", lambda i, b=blocks, xs=xs, ws=ws: gemv(xs, ws[i], b),
                       lambda b=blocks, xs=xs, ws=ws: _err(gemv(xs, ws[0], b), xs.float() @ ws[0].float().t()), nbytes, rows,
                       shape=shape, blocks=blocks, pdl=PDL_ENABLED)
            best = min(best, (us, blocks))
        us, blocks = best
        print(f"  gemv best {blocks}: {us:.2f} us ({nbytes / us / 1e3:.0f} GB/s), {cublas / us:.2f}x cuBLAS")
        if shape in ("qkv", "gate_up"):
            nw = torch.ones(k, device="cuda", dtype=DTYPE)
            res = torch.randn_like(xs)
            best = (float("inf"), None)
            for bn, bk, wp in itertools.product(bns, bks, warps):
                blocks3 = (bn, bk, wp)
                us = _time("rmsnorm_linear", lambda i, b=blocks3, xs=xs, ws=ws, nw=nw, res=res: rmsnorm_linear(xs, nw, ws[i], residual=res, blocks=b),
                           None, nbytes, rows, shape=shape, blocks=blocks3)
                best = min(best, (us, blocks3))
            print(f"  rmsnorm_linear best {best[1]}: {best[0]:.2f} us ({nbytes / best[0] / 1e3:.0f} GB/s)")
        if shape == "down":
            gu = torch.randn(1, 2 * FFN, device="cuda").to(DTYPE)
            best = (float("inf"), None)
            for bn, bk, wp, st in itertools.product(bns, bks, warps, swiglu_stages):
                blocks = (bn, bk, wp, st)
                us = _time("swiglu_linear", lambda i, b=blocks, ws=ws, gu=gu: swiglu_linear(gu, ws[i], blocks=b), None, nbytes,
                           rows, shape=shape, blocks=blocks)
                best = min(best, (us, blocks))
            print(f"  swiglu_linear best {best[1]}: {best[0]:.2f} us ({nbytes / best[0] / 1e3:.0f} GB/s)")
        ws.clear()  # free this shape's weights before the next one
        torch.cuda.empty_cache()
    _write(args.out, rows, date)
    return 0


def _write(out: str | None, rows: list[dict], date: str) -> None:
    if out:
        with open(out, "a") as fh:
            for r in rows:
                fh.write(json.dumps({"device": torch.cuda.get_device_name(), "date": date, **r}) + "\n")


#: (BLOCK_N, BLOCK_K, warps, stages) for the TMA GEMV: TMA boxes are at most 256 elements a side
TMA_CANDIDATES = ((128, 64, 4, 8), (128, 64, 4, 12), (64, 64, 4, 8), (64, 128, 4, 6), (64, 128, 4, 8),
                  (32, 128, 4, 8), (32, 256, 4, 6), (16, 256, 4, 6), (16, 256, 4, 4), (16, 128, 4, 8),
                  (8, 256, 4, 6), (128, 128, 8, 6), (256, 64, 8, 6))


def _sweep_tma(x: torch.Tensor, rows: list[dict]) -> None:
    for shape, (n, k) in SHAPES.items():
        ws = _weights(n, k)
        xs = x[:, :k]
        nbytes = n * k * DTYPE.itemsize
        cublas = _time("cublas", lambda i, xs=xs, ws=ws: torch.nn.functional.linear(xs, ws[i]), None, nbytes, rows, shape=shape)
        best_ldg = _time("gemv", lambda i, xs=xs, ws=ws, b=BEST_LDG[shape]: gemv(xs, ws[i], b), None, nbytes, rows, shape=shape,
                         blocks=BEST_LDG[shape], pdl=PDL_ENABLED)
        best = (float("inf"), None)
        for blocks in TMA_CANDIDATES:
            us = _time("gemv_tma", lambda i, b=blocks, xs=xs, ws=ws: gemv_tma(xs, ws[i], b),
                       lambda b=blocks, xs=xs, ws=ws: _err(gemv_tma(xs, ws[0], b), xs.float() @ ws[0].float().t()), nbytes, rows,
                       shape=shape, blocks=blocks, pdl=True)
            print(f"  tma {blocks}: {us:.2f} us")
            best = min(best, (us, blocks))
        print(f"{shape} [{n}x{k}] cuBLAS {cublas:.2f} us, gemv {best_ldg:.2f}, gemv_tma best {best[1]} {best[0]:.2f} us "
              f"({nbytes / best[0] / 1e3:.0f} GB/s)")
        ws.clear()  # free this shape's weights before the next one
        torch.cuda.empty_cache()


#: the best plain-load tiles of the first sweep (H200, 2026-11-22)
BEST_LDG = {"qkv": (8, 2048, 4, 3), "o": (8, 2048, 8, 3), "gate_up": (4, 1024, 4, 3), "down": (4, 2048, 8, 3)}


if __name__ == "__main__":
    sys.exit(main())
