"""Paged decode benchmark: achieved GB/s of KV read against the copy bandwidth, beside SDPA on a contiguous cache.

Sizes (``SIZES``): bf16, 16 query heads over 4 key/value heads (GQA 4), head
dim 128, pool blocks of 16 tokens scattered at random, one new token per
sequence, batch 1, 8, 64 and contexts 1k..32k. KV bytes = B * ctx * KV * Dh *
2 (k and v) * 2 bytes; GB/s = KV bytes / median time (``do_bench`` flushes L2
between runs, so the cache is read from HBM). The copy bandwidth is a 2 GiB
device-to-device copy counting bytes read plus written.

    python bench_paged_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

from plyx.kernel.attention import paged_attention_triton
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
}


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    n = SIZES["copy_bytes"] // 2
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s, read + write


def bench_case(B: int, ctx: int) -> dict[str, object]:
    H, KV, D, bs, Tq = SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["block_size"], SIZES["new_tokens"]
    dtype = getattr(torch, SIZES["dtype"])
    blocks_per_seq = ctx // bs
    num_blocks = B * blocks_per_seq
    k_pool = torch.randn(num_blocks, bs, KV, D, device="cuda", dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_blocks, device="cuda").view(B, blocks_per_seq).to(torch.int32)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(B, Tq, H, D, device="cuda", dtype=dtype)
    kv_bytes = 2 * B * ctx * KV * D * k_pool.element_size()
    splits = num_splits_for(B, KV, ctx, 64, _sm_count(q.device))
    ms = _time(lambda: paged_attention_triton(q, k_pool, v_pool, tables, lens))
    row: dict[str, object] = {"B": B, "ctx": ctx, "splits": splits, "kv_MB": kv_bytes / 1e6,
                              "triton": {"ms": ms, "GBps": kv_bytes / ms / 1e6}}
    # the same cache contiguous, [B, KV, ctx, Dh], through SDPA (whatever backend torch picks)
    k_c = k_pool[tables.long()].reshape(B, ctx, KV, D).transpose(1, 2).contiguous()
    v_c = v_pool[tables.long()].reshape(B, ctx, KV, D).transpose(1, 2).contiguous()
    q_c = q.transpose(1, 2)
    ours = paged_attention_triton(q, k_pool, v_pool, tables, lens).float()
    del k_pool, v_pool
    try:
        ms_s = _time(lambda: F.scaled_dot_product_attention(q_c, k_c, v_c, enable_gqa=True))
        row["sdpa_contiguous"] = {"ms": ms_s, "GBps": kv_bytes / ms_s / 1e6}
        ref = F.scaled_dot_product_attention(q_c, k_c, v_c, enable_gqa=True).transpose(1, 2).float()
        row["rel_err_vs_sdpa"] = float((ours - ref).norm() / ref.norm())
    except RuntimeError as exc:
        row["sdpa_contiguous"] = {"error": str(exc)[:200]}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file, rewritten after each case")
    args = parser.parse_args()
    copy = copy_bandwidth()
    result = {"sizes": SIZES, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": copy, "cases": []}
    print(f"copy bandwidth {copy:.0f} GB/s (read + write)", flush=True)
    for B in SIZES["batches"]:
        for ctx in SIZES["contexts"]:
            row = bench_case(B, ctx)
            row["triton"]["of_copy"] = row["triton"]["GBps"] / copy
            result["cases"].append(row)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            s = row["sdpa_contiguous"]
            print(f"B={B:3} ctx={ctx:6} splits={row['splits']:3} triton {row['triton']['ms'] * 1e3:8.1f} us "
                  f"{row['triton']['GBps']:7.0f} GB/s ({100 * row['triton']['of_copy']:5.1f}% of copy) | sdpa "
                  f"{s.get('GBps', float('nan')):7.0f} GB/s", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
