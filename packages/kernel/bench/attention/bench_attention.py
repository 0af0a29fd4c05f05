"""Flash attention benchmark: Triton forward and forward+backward beside torch SDPA's flash and cuDNN backends.

Sizes (``SIZES``): bf16, head dim 128, 16 heads, B x T = 16,384 tokens, T in
1k, 4k, 16k, causal and full. FLOPs follow the FlashAttention papers: forward
4 * B * H * T * S * Dh (halved when causal), forward+backward 3.5 x that.
Each figure is the median of ``triton.testing.do_bench``. The Triton kernels
are timed autotuned (tuning not timed; the configs chosen are reported) and
with their built-in default configs (what runs without PLYX_ATTENTION_AUTOTUNE=1).

    python bench_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from plyx.kernel.attention import attention_triton
from plyx.kernel.attention._flash import best_configs
from torch.nn.attention import SDPBackend, sdpa_kernel

SIZES = {
    "tokens": 16384,  # B x T
    "heads": 16,
    "head_dim": 128,
    "seq_lens": [1024, 4096, 16384],
    "causal": [False, True],
    "dtype": "bfloat16",
}
BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def _flops(B: int, T: int, H: int, D: int, causal: bool) -> float:
    return 4.0 * B * H * T * T * D / (2 if causal else 1)


def _time(fn, grads=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grads, return_mode="median")


def bench_case(T: int, causal: bool) -> dict[str, object]:
    H, D = SIZES["heads"], SIZES["head_dim"]
    B = SIZES["tokens"] // T
    dtype = getattr(torch, SIZES["dtype"])
    # fresh random data (never zeros); plyx layout [B, T, H, Dh], SDPA's [B, H, T, Dh]
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(3))
    do = torch.randn_like(q)
    flops = _flops(B, T, H, D, causal)
    row: dict[str, object] = {"T": T, "B": B, "causal": causal}

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    # "triton": autotuned (PLYX_ATTENTION_AUTOTUNE=1); "triton_default": the built-in default configs
    for name, tune in (("triton", "1"), ("triton_default", "0")):
        os.environ["PLYX_ATTENTION_AUTOTUNE"] = tune
        t0 = time.time()
        o = attention_triton(qg, kg, vg, causal=causal)
        o.backward(do)  # compiles (and tunes) all three kernels
        torch.cuda.synchronize()
        row[f"{name}_setup_s"] = round(time.time() - t0, 1)
        ms_f = _time(lambda: attention_triton(q, k, v, causal=causal))
        ms_fb = _time(lambda: attention_triton(qg, kg, vg, causal=causal).backward(do), grads=[qg, kg, vg])
        row[name] = {"fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "fwd_tflops": flops / ms_f / 1e9,
                     "fwd_bwd_tflops": 3.5 * flops / ms_fb / 1e9}
    row["tune_s"] = row["triton_setup_s"]
    os.environ["PLYX_ATTENTION_AUTOTUNE"] = "1"

    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    ref_o = None
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel(backend):
                ms_f = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                qs, ks, vs = (x.clone().requires_grad_() for x in (qt, kt, vt))
                ms_fb = _time(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=causal).backward(dot), grads=[qs, ks, vs])
                if ref_o is None:
                    ref_o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
            row[name] = {"fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "fwd_tflops": flops / ms_f / 1e9,
                         "fwd_bwd_tflops": 3.5 * flops / ms_fb / 1e9}
        except RuntimeError as exc:  # a backend that refuses this shape or GPU
            row[name] = {"error": str(exc)[:200]}
    if ref_o is not None:
        o = attention_triton(q, k, v, causal=causal)
        row["rel_err_vs_sdpa"] = float((o.float() - ref_o.float()).norm() / ref_o.float().norm())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file, rewritten after each case")
    parser.add_argument("--seq-lens", type=int, nargs="*", default=SIZES["seq_lens"])
    args = parser.parse_args()
    result = {"sizes": SIZES, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cases": []}
    for causal in SIZES["causal"]:
        for T in args.seq_lens:
            row = bench_case(T, causal)
            result["cases"].append(row)
            result["configs"] = best_configs()
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            tri, fl, cu = row["triton"], row.get("sdpa_flash", {}), row.get("sdpa_cudnn", {})
            print(f"causal={causal!s:5} T={T:6} triton fwd {tri['fwd_tflops']:6.1f} fwd+bwd {tri['fwd_bwd_tflops']:6.1f} | "
                  f"flash {fl.get('fwd_tflops', float('nan')):6.1f} {fl.get('fwd_bwd_tflops', float('nan')):6.1f} | "
                  f"cudnn {cu.get('fwd_tflops', float('nan')):6.1f} {cu.get('fwd_bwd_tflops', float('nan')):6.1f} "
                  f"| default {row['triton_default']['fwd_tflops']:6.1f} {row['triton_default']['fwd_bwd_tflops']:6.1f} "
                  f"| err {row.get('rel_err_vs_sdpa', float('nan')):.1e} tune {row['tune_s']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
