"""``generate`` through the engine against the pre-engine decode loop (``plyx.serve._reference``), same run.

Each workload (greedy and sampled, a few batch sizes) runs both ways, alternating, ``--repeats`` times; the
best time of each side is kept (wall and process CPU time: ratios > 1 mean the engine is faster), and the
tokens are compared (greedy: equal; sampled: both seeded, and since serve 1.8 different by design: the engine
draws from counter-based Philox streams, the reference loop from torch generators). The
reference loop is exactly what ``generate`` ran before it became a client of the engine, so its column is
"before" and the engine's "after", interleaved on one machine.

    python packages/serve/bench/bench_decode_path.py --config small --batch 1,8,32 --new-tokens 64
    python packages/serve/bench/bench_decode_path.py --device cuda --dtype bfloat16 --config 1.1b --batch 1,32 \\
        --new-tokens 256 --out $OUT

Results: a table on stdout and JSON lines appended to ``<out>/decode-path-<device>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

# Llama-shaped configurations (random weights); "small" is the serving benchmark's small CPU model
CONFIGS = {
    "tiny": dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=344, vocab_size=1024),
    "small": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688, vocab_size=1024),
    "100m": dict(d_model=768, n_layers=10, n_heads=12, n_kv_heads=4, d_ff=2048, vocab_size=32000),
    "1.1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab_size=32000),
}


def build(name: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(**CONFIGS[name], max_seq_len=2048, init_std=0.1)
    return TransformerLM(config).to(device=device, dtype=dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(side: str, model: torch.nn.Module, prompts: list[list[int]], params) -> tuple[float, float, list[list[int]]]:
    """One call: (wall seconds, process CPU seconds, tokens). On a shared CPU the process time is the steadier
    figure (other processes' load stretches the wall time of whichever side runs at that moment)."""
    from plyx.serve import generate
    from plyx.serve._reference import reference_generate

    fn = generate if side == "engine" else reference_generate
    device = next(model.parameters()).device
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    outs = fn(model, prompts, params)
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    from plyx.serve import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, alternating; the best is kept")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.config, getattr(torch, args.dtype), args.device)
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else
                   f"{platform.processor() or platform.machine()} x{os.cpu_count()} threads={torch.get_num_threads()}")
    print(f"{args.config} on {device_name}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, CONFIGS[args.config]["vocab_size"], (b, args.prompt_len), generator=g).tolist()
        for mode in args.modes.split(","):
            if mode == "greedy":
                params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
            else:
                params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_new_tokens=args.new_tokens,
                                         ignore_eos=True) for i in range(b)]
            for side in ("reference", "engine"):  # warm-up: allocator, kernels, graphs, the kept engine
                run(side, model, prompts, params)
            best: dict[str, float] = {}
            best_cpu: dict[str, float] = {}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for side in ("reference", "engine"):
                    s, c, toks = run(side, model, prompts, params)
                    best[side] = min(best.get(side, float("inf")), s)
                    best_cpu[side] = min(best_cpu.get(side, float("inf")), c)
                    tokens[side] = toks
            n = b * args.new_tokens
            row = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device_name,
                   "torch": torch.__version__, "dtype": args.dtype, "config": args.config, "batch": b, "mode": mode,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
                   "reference_tok_s": n / best["reference"], "engine_tok_s": n / best["engine"],
                   "engine_over_reference": best["reference"] / best["engine"],
                   "reference_cpu_s": best_cpu["reference"], "engine_cpu_s": best_cpu["engine"],
                   "engine_over_reference_cpu": best_cpu["reference"] / best_cpu["engine"],
                   "same_tokens": tokens["reference"] == tokens["engine"]}
            rows.append(row)
            print(f"batch {b:3d} {mode:8s} reference {row['reference_tok_s']:9.1f} tok/s  engine "
                  f"{row['engine_tok_s']:9.1f} tok/s  engine/reference {row['engine_over_reference']:.2f} "
                  f"(process time {row['engine_over_reference_cpu']:.2f})  "
                  f"same tokens {row['same_tokens']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    with open(out / f"decode-path-{kind}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
