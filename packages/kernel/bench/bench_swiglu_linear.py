"""``swiglu_linear`` against the unfused path it replaces (plyx's ``swiglu`` + cuBLAS), as a decode step runs it.

    python packages/kernel/bench/bench_swiglu_linear.py [--sweep] [--out FILE]

The down projection of the TinyLlama-1.1B shape (``[2048, 5632]`` bf16) at one and two rows: one CUDA graph
over 22 distinct weights (one per layer, so nothing is served from L2), timed per matrix, with the weight
bandwidth reached and the ratio (unfused / fused; > 1: the fused kernel is faster). CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rmsnorm_linear import _header, graph_time

LAYERS, D, FF = 22, 2048, 5632


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, BLOCK_K, warps, stages)")
    ap.add_argument("--out", default=None, help="append one JSON line per row count to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_swiglu_linear: no CUDA device; nothing to time")
        return 0
    from plyx.kernel.triton_ops.swiglu import swiglu
    from plyx.kernel.triton_ops.swiglu_linear import swiglu_linear

    head = _header()
    print(f"swiglu_linear vs swiglu + F.linear | {head['device']} | torch {head['torch']} | {head['date']}")
    weights = [torch.randn(D, FF, device="cuda", dtype=torch.bfloat16) * FF ** -0.5 for _ in range(LAYERS)]
    nbytes = D * FF * 2
    for m in (1, 2):
        gu = torch.randn(m, 2 * FF, device="cuda", dtype=torch.bfloat16)

        def unfused(i: int, gu: torch.Tensor = gu) -> torch.Tensor:
            gate, up = gu.chunk(2, dim=-1)
            return F.linear(swiglu(gate, up), weights[i])

        want = unfused(0).float()
        got = swiglu_linear(gu, weights[0]).float()
        err = float((got - want).abs().max() / want.abs().max())
        t_unfused = graph_time(unfused, LAYERS)
        t_fused = graph_time(lambda i, gu=gu: swiglu_linear(gu, weights[i]), LAYERS)
        row = {**head, "shape": "down", "n": D, "k": FF, "m": m, "unfused_us": t_unfused, "fused_us": t_fused,
               "ratio": t_unfused / t_fused, "err_y": err, "weight_gbps_unfused": nbytes / t_unfused / 1e3,
               "weight_gbps_fused": nbytes / t_fused / 1e3}
        line = (f"down [{D}x{FF}] M={m}: swiglu + cuBLAS {t_unfused:.2f} us ({row['weight_gbps_unfused']:.0f} GB/s)  "
                f"swiglu_linear {t_fused:.2f} us ({row['weight_gbps_fused']:.0f} GB/s)  ratio {row['ratio']:.2f}  err {err:.1e}")
        if args.sweep:
            best = min((graph_time(lambda i, b=b, gu=gu: swiglu_linear(gu, weights[i], blocks=b), LAYERS), b)
                       for b in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (2, 3, 4)))
            row["sweep_best"], row["sweep_best_us"] = best[1], best[0]
            line += f"  | best {best[0]:.2f} us {best[1]}"
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
