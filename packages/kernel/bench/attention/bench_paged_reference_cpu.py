"""CPU timing of ``paged_attention_reference``: the batched gather against the former per-sequence loop.

The serving engine's CPU decode step calls the reference once per layer, so its
cost is Python overhead as much as arithmetic. Sizes (``SIZES``): float32,
batch 32, contexts drawn uniformly in 64..512, 4 query heads over 2 key/value
heads, head dim 16, blocks of 16 tokens scattered at random, Tq in {1, 4}.
Prints the median milliseconds per call of both versions and the speed-up.

    python bench_paged_reference_cpu.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from plyx.kernel.attention import paged_attention_reference
from plyx.kernel.attention._reference import paged_attention_per_sequence

SIZES = {"batch": 32, "contexts": (64, 512), "heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 16,
         "new_tokens": [1, 4], "repeats": 30}


per_sequence_loop = paged_attention_per_sequence  # the reference as it was before batching (the "before" figure)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s = SIZES
    B, bs = s["batch"], s["block_size"]
    lens = torch.randint(s["contexts"][0], s["contexts"][1] + 1, (B,), dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // bs)
    num_blocks = B * max_blocks + 8
    k_pool = torch.randn(num_blocks, bs, s["kv_heads"], s["head_dim"])
    v_pool = torch.randn(num_blocks, bs, s["kv_heads"], s["head_dim"])
    tables = torch.randperm(num_blocks)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={B}, contexts {s['contexts']}, "
          f"H={s['heads']}, KV={s['kv_heads']}, Dh={s['head_dim']}, block {bs}, float32")
    for Tq in s["new_tokens"]:
        q = torch.randn(B, Tq, s["heads"], s["head_dim"])
        before = _median_ms(lambda q=q: per_sequence_loop(q, k_pool, v_pool, tables, lens), s["repeats"])
        after = _median_ms(lambda q=q: paged_attention_reference(q, k_pool, v_pool, tables, lens), s["repeats"])
        print(f"Tq={Tq}: per-sequence loop {before:.2f} ms, batched {after:.2f} ms, {before / after:.1f}x")


if __name__ == "__main__":
    main()
