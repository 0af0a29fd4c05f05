"""Paged decode benchmark: achieved GB/s of KV read against the copy bandwidth, beside SDPA on a contiguous cache.

Sizes (``SIZES``): bf16, 16 query heads over 4 key/value heads (GQA 4), head
dim 128, pool blocks of 16 tokens scattered at random, one new token per
sequence, batch 1, 8, 64 and contexts 1k..32k. KV bytes = B * ctx * KV * Dh *
2 (k and v) * 2 bytes; GB/s = KV bytes / median time (``do_bench`` flushes L2
between runs, so the cache is read from HBM). "call" figures time whole calls
(Python, launches and kernels); "kernel" figures sum the GPU time of the
kernels a call launches (torch.profiler, L2 flushed before each call), which
is what a CUDA-graph-captured decode step would pay. The copy bandwidth is a
2 GiB device-to-device copy counting bytes read plus written.

    python bench_paged_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
from plyx.kernel.attention import _paged, paged_attention_triton
from plyx.kernel.attention._paged import _sm_count, num_splits_for

SIZES = {
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 128,
    "block_size": 16,
    "new_tokens": 1,
    "batches": [1, 8, 64],
    "contexts": [1024, 2048, 4096, 8192, 16384, 32768],
    "dtype": "bfloat16",
    "copy_bytes": 2 << 30,
    # launch configs tried by --sweep: (block_n, num_warps, num_stages), on (batch, context) cases
    "sweep_configs": [(32, 2, 3), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3),
                      (128, 8, 3), (128, 8, 2)],
    "sweep_cases": [(1, 32768), (8, 8192), (64, 4096)],
}


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_ms(fn, iters: int = 20) -> float:
    """GPU time of the kernels ``fn`` launches per call (profiler), L2 flushed before each call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA or "fill" in evt.key.lower():
            continue  # CPU-side records and the L2 flush
        total_us += getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
    return total_us / iters / 1e3


def copy_bandwidth() -> float:
    n = SIZES["copy_bytes"] // 2
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s, read + write


def _make(B: int, ctx: int):
    H, KV, D, bs, Tq = SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["block_size"], SIZES["new_tokens"]
    dtype = getattr(torch, SIZES["dtype"])
    num_blocks = B * (ctx // bs)
    k_pool = torch.randn(num_blocks, bs, KV, D, device="cuda", dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_blocks, device="cuda").view(B, ctx // bs).to(torch.int32)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(B, Tq, H, D, device="cuda", dtype=dtype)
    return q, k_pool, v_pool, tables, lens


def sweep() -> list[dict[str, object]]:
    """Kernel time of each launch config on a few cases; the best geometric mean is printed."""
    rows = []
    defaults = dict(_paged.GPU_CONFIG_SPLIT), dict(_paged.GPU_CONFIG_SINGLE)
    cases = [(B, ctx, _make(B, ctx)) for B, ctx in SIZES["sweep_cases"]]
    for bn, warps, stages in SIZES["sweep_configs"]:
        for config in (_paged.GPU_CONFIG_SPLIT, _paged.GPU_CONFIG_SINGLE):  # the same config split or not
            config.update(block_n=bn, num_warps=warps, num_stages=stages)
        row: dict[str, object] = {"block_n": bn, "num_warps": warps, "num_stages": stages}
        try:
            for B, ctx, args in cases:
                row[f"B{B}_ctx{ctx}_kernel_us"] = kernel_ms(lambda args=args: paged_attention_triton(*args)) * 1e3
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            row["error"] = str(exc)[:160]
        rows.append(row)
        print("sweep", row, flush=True)
    _paged.GPU_CONFIG_SPLIT.update(defaults[0])
    _paged.GPU_CONFIG_SINGLE.update(defaults[1])
    ok = [r for r in rows if "error" not in r]
    if ok:
        import math

        best = min(ok, key=lambda r: math.prod(v for k, v in r.items() if k.endswith("_us")))
        print("sweep best", best, flush=True)
    return rows


def bench_case(B: int, ctx: int) -> dict[str, object]:
    KV, D = SIZES["kv_heads"], SIZES["head_dim"]
    q, k_pool, v_pool, tables, lens = _make(B, ctx)
    kv_bytes = 2 * B * ctx * KV * D * k_pool.element_size()
    splits = num_splits_for(B, KV, ctx, _paged.GPU_CONFIG_SPLIT["block_n"], _sm_count(q.device))

    def ours() -> torch.Tensor:
        return paged_attention_triton(q, k_pool, v_pool, tables, lens)

    ms, kms = _time(ours), kernel_ms(ours)
    row: dict[str, object] = {"B": B, "ctx": ctx, "splits": splits, "kv_MB": kv_bytes / 1e6,
                              "triton": {"ms": ms, "GBps": kv_bytes / ms / 1e6, "kernel_ms": kms,
                                         "kernel_GBps": kv_bytes / kms / 1e6}}
    out = ours().float()
    # the same cache contiguous, [B, KV, ctx, Dh], through SDPA (whatever backend torch picks)
    k_c = k_pool[tables.long()].reshape(B, ctx, KV, D).transpose(1, 2).contiguous()
    v_c = v_pool[tables.long()].reshape(B, ctx, KV, D).transpose(1, 2).contiguous()
    q_c = q.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_c, k_c, v_c, enable_gqa=True)

    try:
        ms_s, kms_s = _time(sdpa), kernel_ms(sdpa)
        row["sdpa_contiguous"] = {"ms": ms_s, "GBps": kv_bytes / ms_s / 1e6, "kernel_ms": kms_s,
                                  "kernel_GBps": kv_bytes / kms_s / 1e6}
        ref = sdpa().transpose(1, 2).float()
        row["rel_err_vs_sdpa"] = float((out - ref).norm() / ref.norm())
    except RuntimeError as exc:
        row["sdpa_contiguous"] = {"error": str(exc)[:200]}
    return row


#: ``--engine-shape``: an engine's decode step (the 1.1B serving benchmark: 32 heads over 4, head dim 64, 32 rows)
#: whose tables are as wide as max_model_len while the sequences are shorter; every split count timed
ENGINE_SHAPE = {"heads": 32, "kv_heads": 4, "head_dim": 64, "block_size": 16, "batch": 32, "table_columns": 45,
                "contexts": [64, 128, 256, 512, 700], "splits": [1, 2, 3, 4, 5, 6, 8]}


def engine_shape() -> list[dict[str, object]]:
    """Kernel time per split count at the engine's shape (short sequences in a wide table)."""
    e = ENGINE_SHAPE
    B, H, KV, D, bs, width = e["batch"], e["heads"], e["kv_heads"], e["head_dim"], e["block_size"], e["table_columns"]
    dtype = getattr(torch, SIZES["dtype"])
    k_pool = torch.randn(B * width, bs, KV, D, device="cuda", dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(B * width, device="cuda").view(B, width).to(torch.int32)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dtype)
    rows = []
    for ctx in e["contexts"]:
        lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
        default = num_splits_for(B, KV, width * bs, _paged.GPU_CONFIG_SPLIT["block_n"], _sm_count(q.device))
        row: dict[str, object] = {"ctx": ctx, "default_splits": default}
        for n in e["splits"]:
            row[f"splits{n}_us"] = kernel_ms(lambda n=n, lens=lens: paged_attention_triton(q, k_pool, v_pool, tables, lens,
                                                                                num_splits=n)) * 1e3
        rows.append(row)
        print("engine shape", row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file, rewritten after each case")
    parser.add_argument("--sweep", action="store_true", help="also time the launch configs of SIZES['sweep_configs']")
    parser.add_argument("--engine-shape", action="store_true",
                        help="only the engine-shape split sweep (ENGINE_SHAPE), written to --out")
    args = parser.parse_args()
    if args.engine_shape:
        result = {"engine_shape": ENGINE_SHAPE, "device": torch.cuda.get_device_name(), "cases": engine_shape()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return 0
    copy = copy_bandwidth()
    result = {"sizes": SIZES, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": copy,
              "config": {"split": dict(_paged.GPU_CONFIG_SPLIT), "single": dict(_paged.GPU_CONFIG_SINGLE)}, "cases": []}
    if args.sweep:
        result["sweep"] = sweep()
    print(f"copy bandwidth {copy:.0f} GB/s (read + write)", flush=True)
    for B in SIZES["batches"]:
        for ctx in SIZES["contexts"]:
            row = bench_case(B, ctx)
            row["triton"]["of_copy"] = row["triton"]["GBps"] / copy
            row["triton"]["kernel_of_copy"] = row["triton"]["kernel_GBps"] / copy
            result["cases"].append(row)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            s = row["sdpa_contiguous"]
            print(f"B={B:3} ctx={ctx:6} splits={row['splits']:3} triton {row['triton']['ms'] * 1e3:8.1f} us "
                  f"{row['triton']['GBps']:7.0f} GB/s ({100 * row['triton']['of_copy']:5.1f}% of copy) kernel "
                  f"{row['triton']['kernel_ms'] * 1e3:8.1f} us {100 * row['triton']['kernel_of_copy']:5.1f}% | sdpa "
                  f"{s.get('GBps', float('nan')):7.0f} GB/s kernel {s.get('kernel_GBps', float('nan')):7.0f}", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
