"""Where the host time of ``generate``'s decode loop goes: cProfile of one greedy run, top functions.

    python packages/serve/bench/profile_generate.py --device cuda --config 1.1b --batch 1 --new-tokens 128

With CUDA graphs the GPU work of a step is one replay; what is left on the host (reserving slots,
filling the pinned buffer, sampling, the per-step bookkeeping) is what this shows.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import CONFIGS, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="100m", choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cache", default="paged")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from plyx.serve import SamplingParams, generate

    _, model = build(args.config, getattr(torch, args.dtype), args.device)
    prompts = torch.randint(3, CONFIGS[args.config]["vocab_size"], (args.batch, 32)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    run = lambda: generate(model, prompts, params, cache=args.cache, cuda_graphs=False if args.eager else None)  # noqa: E731
    run()  # warm-up: kernels compiled, graphs captured for this batch
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"{args.config} batch {args.batch} {args.cache}{' eager' if args.eager else ''}: "
          f"{args.batch * args.new_tokens / wall:.1f} tok/s, {wall / args.new_tokens * 1e3:.3f} ms per step")
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
