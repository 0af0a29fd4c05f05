"""Decode GPU time per step: the engine's k-step graph against the reference loop, by context length.

For each context C: (1) the engine (paged pool, ``decode_steps`` 8) with ``--batch`` rows prefilled to C
tokens, the GPU time of one ``greedy_steps`` replay (CUDA events) per step; (2) the reference loop
(``reference_generate``, contiguous cache, graphs) per decode step, from two runs that differ only in the
number of new tokens (their difference is decode steps alone); (3) the kernels of one eager decode step of
each (torch.profiler), so a difference can be named.

    python packages/serve/bench/diag_decode_gpu.py --model 1.1b --batch 32 --contexts 64,256,512
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_serving import build
from serving import MODELS


def kernel_table(fn, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0)
        if t > 0:
            rows[e.key[:70]] = (t / steps, e.count / steps)
    total = sum(t for t, _ in rows.values())
    out = [f"  total {total:.1f} us per step"]
    for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"  {t:8.1f} us  x{n:5.1f}  {k}")
    return "\n".join(out)


def filled_engine(model, prompts: list[list[int]], max_len: int, **config) -> object:
    """An engine with every prompt prefilled and decoding (a few steps taken: graphs captured, kernels built)."""
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    eng = Engine(model, config=EngineConfig(max_batch_size=len(prompts), max_batch_tokens=4096, max_model_len=max_len,
                                            **config))
    params = SamplingParams(temperature=0, max_new_tokens=150, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, params)
    while any(s.pending > 1 for s in eng.running) or eng.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    return eng


def engine_block_ms(model, prompts: list[list[int]], max_len: int) -> float:
    """GPU ms per step of an 8-step ``greedy_steps`` replay (CUDA events; median of 6 replays)."""
    eng = filled_engine(model, prompts, max_len, decode_steps=8)
    eng._block_ahead = None  # the look-ahead's queued block is dropped: the replays below are timed alone
    seqs = list(eng.running)
    ids = [s.seq_id for s in seqs]
    first = torch.tensor([s.tokens[-1] for s in seqs], device="cuda")
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        eng.graphs.greedy_steps(ids, first, 8)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 8)
    return sorted(times)[len(times) // 2]


def reference_step_ms(model, prompts: list[list[int]]) -> float:
    """ms per decode step of the reference loop: two runs differing only in new tokens (16, 80), differenced."""
    from plyx.serve import SamplingParams
    from plyx.serve._reference import reference_generate

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        reference_generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(16), run(80)  # warm
    return sorted((run(80) - run(16)) / 64 * 1e3 for _ in range(3))[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.1b", choices=list(MODELS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", default="64,256,512")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    from plyx.serve import SamplingParams
    from plyx.serve._reference import reference_generate

    model = build(args)
    ref_params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    vocab = MODELS[args.model]["vocab_size"]
    rng = random.Random(0)
    print(f"# {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')} model {args.model} batch {args.batch}")
    for C in [int(c) for c in args.contexts.split(",")]:
        prompts = [[rng.randrange(8, vocab) for _ in range(C)] for _ in range(args.batch)]
        eng_ms, ref_ms = engine_block_ms(model, prompts, C + 200), reference_step_ms(model, prompts)
        print(f"C={C}: engine greedy_steps GPU {eng_ms:.3f} ms/step | reference loop {ref_ms:.3f} ms/step "
              f"| ratio {eng_ms / ref_ms:.2f}", flush=True)
        eager = filled_engine(model, prompts, C + 200, decode_steps=1, cuda_graphs=False)
        print(f" engine eager step kernels at C={C}:\n"
              + kernel_table(lambda eager=eager: [eager.step() for _ in range(4)], 4, args.top), flush=True)
        print(f" reference eager (no graphs) kernels, 16 new tokens from C={C} (incl. prefill/16):\n" + kernel_table(
            lambda prompts=prompts: reference_generate(model, prompts, ref_params, cuda_graphs=False), 16, args.top),
            flush=True)
        del eager
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
