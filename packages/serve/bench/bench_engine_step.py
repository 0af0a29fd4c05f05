"""The engine alone (no server): the packed step against the per-group step on one workload, alternating.

``serving.py``'s workload shape (input ``--input-len``±50% + a shared ``--prefix-len``, output
``--output-len``±50%, all requests at once) run to completion by ``Engine.generate`` with
``EngineConfig.packed_step`` on and off, alternating ``--repeats`` times (best of each kept), greedy
tokens checked identical. Without the HTTP path and the client process, this is the step's own cost,
and alternating takes the load of a shared machine out of the comparison.

    python packages/serve/bench/bench_engine_step.py                        # CPU, small model
    python packages/serve/bench/bench_engine_step.py --device cuda --model 1.1b --num-prompts 128

Printed, and appended as a JSON line to ``bench/results/engine-step-<device>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_serving import build  # (one model builder for the engine benchmarks)
from serving import MODELS, RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bfloat16 on CUDA")
    p.add_argument("--model", default="small", choices=list(MODELS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    model = build(args)
    device = next(model.parameters()).device
    vocab = MODELS[args.model]["vocab_size"]
    rng = random.Random(0)
    prefix = [rng.randrange(8, vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(8, vocab) for _ in range(rng.randint(args.input_len // 2, args.input_len * 3 // 2))]
               for _ in range(args.num_prompts)]
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randint(max(1, args.output_len // 2),
                                                                       args.output_len * 3 // 2), ignore_eos=True)
              for _ in prompts]
    max_len = max(len(q) + sp.max_new_tokens for q, sp in zip(prompts, params))
    best: dict[bool, float] = {}
    cpu: dict[bool, float] = {}
    ratios: list[float] = []  # per round: per-group time / packed time (the pair ran back to back)
    steps: dict[bool, int] = {}
    tokens: dict[bool, list[tuple[int, ...]]] = {}
    for rep in range(args.repeats + 1):  # the first round warms up (allocator, kernels) and is not kept
        pair: dict[bool, float] = {}
        for packed in (True, False) if rep % 2 else (False, True):  # alternate who goes first
            engine = Engine(model, config=EngineConfig(max_batch_size=args.max_batch_size,
                                                       max_batch_tokens=args.max_batch_tokens, max_model_len=max_len,
                                                       packed_step=packed))
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, cpu0 = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, params)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if rep:  # CPU seconds of this process: on a shared machine, wall time includes other jobs' turns
                cpu[packed] = min(cpu.get(packed, float("inf")), time.process_time() - cpu0)
            pair[packed] = elapsed
            if rep:
                best[packed] = min(best.get(packed, float("inf")), elapsed)
            steps[packed] = engine.stats.steps
            tokens[packed] = [o.outputs[0].token_ids for o in outs]
        if rep:
            ratios.append(pair[False] / pair[True])
    out_tokens = sum(len(t) for t in tokens[True])
    row = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "requests": args.num_prompts,
        "input": f"{args.input_len}+-50% + {args.prefix_len}", "output": f"{args.output_len}+-50%",
        "packed_tok_s": out_tokens / best[True], "grouped_tok_s": out_tokens / best[False],
        "packed_step_ms": best[True] * 1e3 / steps[True], "grouped_step_ms": best[False] * 1e3 / steps[False],
        "speedup": best[False] / best[True], "speedup_median_of_pairs": statistics.median(ratios),
        "packed_cpu_s": cpu[True], "grouped_cpu_s": cpu[False], "speedup_cpu_time": cpu[False] / cpu[True],
        "tokens_identical": tokens[True] == tokens[False],
    }
    print(f"{row['device']}, {row['date']}: model {args.model} ({args.dtype}), {args.num_prompts} requests, "
          f"best of {args.repeats} alternating")
    print(f"  packed step:  {row['packed_tok_s']:.1f} output tok/s, {row['packed_step_ms']:.2f} ms/step")
    print(f"  per-group:    {row['grouped_tok_s']:.1f} output tok/s, {row['grouped_step_ms']:.2f} ms/step")
    print(f"  packed / per-group: {row['speedup']:.2f}x (best of each), {row['speedup_median_of_pairs']:.2f}x (median "
          f"of back-to-back pairs); greedy tokens identical: {row['tokens_identical']}")
    print(f"  process CPU time (best): packed {cpu[True]:.2f} s, per-group {cpu[False]:.2f} s: "
          f"{row['speedup_cpu_time']:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / f"engine-step-{device.type}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
