"""Host overhead of one decode step's cache bookkeeping: reserve + append (every layer) + block table.

This is the per-step cost a serving engine pays outside the attention kernel,
for the paged and the contiguous cache, at batch 1, 8 and 64 with contexts of
1k tokens (16-token blocks, 16 layers, float32). Prints microseconds per step; appends to
``packages/attn/bench/results/cache_step.jsonl``.

Usage::

    python packages/attn/bench/cache_step.py [--device cpu|cuda] [--steps 50]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch
from plyx.attn import ContiguousKVCache, PagedKVCache
from plyx.specs import CacheLayout

RESULTS = Path(__file__).parent / "results" / "cache_step.jsonl"
# host bookkeeping does not depend on KV x Dh: small heads keep the pools (~0.7 GB at batch 64) light
LAYERS, KV, DH, BLOCK, CONTEXT = 16, 2, 64, 16, 1024
BATCHES = (1, 8, 64)


def build(kind: str, batch: int, device: str):
    layout = CacheLayout(num_layers=LAYERS, num_kv_heads=KV, head_dim=DH, dtype="float32", device=device,
                         max_seq_len=CONTEXT + 64, block_size=BLOCK, num_blocks=batch * (CONTEXT + 64) // BLOCK)
    cache = PagedKVCache(layout) if kind == "paged" else ContiguousKVCache(layout, max_batch=batch)
    ids = list(range(batch))
    for s in ids:
        cache.allocate(s)
    cache.reserve(ids, [CONTEXT] * batch)  # the prompt's slots (values left as zeros: not what is timed)
    return cache, ids


def time_steps(cache, ids: list[int], steps: int, device: str) -> float:
    k = torch.randn(len(ids), KV, DH, device=device)
    start = time.perf_counter()
    for _ in range(steps):
        cache.reserve(ids, [1] * len(ids))
        for layer in range(LAYERS):
            cache.append(layer, ids, k, k)
        cache.block_table(ids)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    rows = []
    print(f"{'batch':>5} {'paged us/step':>14} {'contiguous us/step':>19}")
    for batch in BATCHES:
        row = {"batch": batch}
        for kind in ("paged", "contiguous"):
            cache, ids = build(kind, batch, args.device)
            time_steps(cache, ids, 3, args.device)  # warm-up
            row[f"{kind}_us"] = time_steps(cache, ids, args.steps, args.device)
        rows.append(row)
        print(f"{batch:>5} {row['paged_us']:>14.0f} {row['contiguous_us']:>19.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "device": args.device, "torch": torch.__version__, "layers": LAYERS, "context": CONTEXT}
    with RESULTS.open("a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
