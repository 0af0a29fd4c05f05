"""Sweep the grouped GEMM's tiles on the MoE shapes, against one dense cuBLAS GEMM of the same FLOPs.

The MoE layer runs three grouped GEMMs per direction (gate/up, down; forward, input gradient, weight
gradient). This times each pass alone for every candidate ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
num_stages)`` and prints, per pass, the best tile and its throughput as a fraction of a dense cuBLAS GEMM
doing the same FLOPs (``[rows, K] @ [K, N]``): the ceiling ``pick_blocks`` is tuned against.

Routing is uniform random top-k over the experts (as a trained router's load is roughly balanced), so
each expert gets about ``tokens * top_k / experts`` rows.

Usage::

    python packages/kernel/bench/sweep_grouped_gemm.py            # CUDA: OLMoE-1B-7B layer, bf16
    python packages/kernel/bench/sweep_grouped_gemm.py --tiny     # CPU proof (interpreter), float32

Results: ``packages/kernel/bench/results/sweep-grouped-gemm-<device>-<date>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
OLMOE = dict(d_model=2048, d_expert=1024, experts=64, top_k=8, tokens=4096)
TINY = dict(d_model=64, d_expert=32, experts=4, top_k=2, tokens=32)

CUDA_TILES = [
    (bm, bn, bk, w, s)
    for bm, bn, bk in [(64, 128, 64), (128, 128, 64), (128, 256, 64), (64, 256, 64), (128, 128, 128), (64, 64, 64)]
    for w, s in [(4, 3), (4, 4), (8, 3), (8, 4)]
    if not (bm * bn >= 128 * 256 and w == 4)  # 128x256 accumulators need 8 warps' registers
]
TINY_TILES = [(16, 32, 32, 4, 1)]


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def _offsets(tokens: int, top_k: int, experts: int, device: torch.device) -> torch.Tensor:
    """Row offsets of each expert's block after a uniform random top-k routing (sorted by expert)."""
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU proof)")
    args = parser.parse_args()

    from plyx.kernel.triton_ops import grouped_gemm as gg

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny or device.type != "cuda" else OLMOE
    tiles = CUDA_TILES if device.type == "cuda" else TINY_TILES
    time_ms = _timer(device)
    d, f, e = shape["d_model"], shape["d_expert"], shape["experts"]
    offsets = _offsets(shape["tokens"], shape["top_k"], e, device)
    rows = int(offsets[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    stamp = dt.date.today().isoformat()
    print(f"{name}, torch {torch.__version__}, {stamp}: {shape}, {rows} rows, {dtype}")

    # (pass name, K, N): gate/up reads [rows, d] against [E, 2f, d]; down reads [rows, f] against [E, d, f]
    gemms = {"gate_up": (d, 2 * f), "down": (f, d)}
    records = []
    for gemm, (k, n) in gemms.items():
        x = torch.randn(rows, k, device=device, dtype=dtype)
        w = torch.randn(e, n, k, device=device, dtype=dtype) / k**0.5
        dy = torch.randn(rows, n, device=device, dtype=dtype)
        flops = 2 * rows * n * k
        a = torch.randn(rows, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        dense_ms = time_ms(lambda a=a, b=b: a @ b)
        passes: dict[str, Callable[[tuple], Any]] = {
            "forward": lambda t, x=x, w=w, n=n: gg._launch(x, w, (w.stride(0), w.stride(1), w.stride(2)), n,
                                                           offsets, t),
            "input_grad": lambda t, dy=dy, w=w, k=k: gg._launch(dy, w, (w.stride(0), w.stride(2), w.stride(1)), k,
                                                                offsets, t),
            "weight_grad": lambda t, dy=dy, x=x, w=w: gg._weight_grad(dy, x, offsets, w.shape, w.dtype, t),
        }
        for pass_name, run in passes.items():
            default = gg.pick_blocks(rows, e)
            best: tuple[float, tuple] | None = None
            for tile in dict.fromkeys([default, *tiles]):
                try:
                    ms = time_ms(lambda t=tile, run=run: run(t))
                except Exception as exc:  # a tile that needs more shared memory than the device has
                    print(f"  {gemm:8s} {pass_name:12s} {tile}: {type(exc).__name__}")
                    continue
                rec = dict(device=name, date=stamp, gemm=gemm, pass_=pass_name, tile=list(tile), ms=ms,
                           tflops=flops / ms / 1e9, of_dense=dense_ms / ms, default=tile == default)
                records.append(rec)
                if best is None or ms < best[0]:
                    best = (ms, tile)
            default_ms = next(r["ms"] for r in records if r["gemm"] == gemm and r["pass_"] == pass_name
                              and r["default"])
            print(f"{gemm:8s} {pass_name:12s} dense {dense_ms:.3f} ms | default {default} {default_ms:.3f} ms "
                  f"({dense_ms / default_ms:.0%} of dense) | best {best[1]} {best[0]:.3f} ms "
                  f"({dense_ms / best[0]:.0%} of dense)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"sweep-grouped-gemm-{'cuda' if device.type == 'cuda' else 'cpu'}-{stamp}.jsonl"
    with out.open("w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
