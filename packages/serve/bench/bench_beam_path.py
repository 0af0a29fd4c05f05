"""``beam_search`` through the engine against its pre-engine decode loop (``plyx.serve._beam._reference``), same run.

Each workload (prompts x beams) runs both ways, alternating, ``--repeats`` times; the best time of each side is
kept (wall and process CPU time: ratios > 1 mean the engine is faster), and the hypotheses are compared (token
ids and scores). The reference loop is exactly what ``beam_search`` ran before it became a client of the engine
(a ``Runner`` over a contiguous cache), so its column is "before" and the engine's "after".

    python packages/serve/bench/bench_beam_path.py --config small --prompts 1,8 --beams 4 --new-tokens 32
    python packages/serve/bench/bench_beam_path.py --device cuda --dtype bfloat16 --config 1.1b --prompts 1,8 \\
        --beams 4 --new-tokens 128 --out $OUT

Results: a table on stdout and JSON lines appended to ``<out>/beam-path-<device>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from bench_decode_path import CONFIGS, build


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(side: str, model: torch.nn.Module, prompts: list[list[int]], params) -> tuple[float, float, list[Any]]:
    """One call: (wall seconds, process CPU seconds, [(token ids, score)] of every hypothesis)."""
    from plyx.serve import beam_search
    from plyx.serve._beam import _reference
    from plyx.serve._generate import _Plan
    from plyx.serve._params import SamplingParams

    device = next(model.parameters()).device
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    if side == "engine":
        outs = beam_search(model, prompts, params, eos_token_id=[])
    else:  # the loop beam_search ran before: a Runner on a contiguous cache
        sp = SamplingParams(n=params.num_beams, temperature=0.0, max_new_tokens=params.max_new_tokens)
        outs = _reference(model, _Plan(model, prompts, sp, None, []), params, "contiguous")
    _sync(device)
    hyps = [(list(c.token_ids), c.score) for o in outs for c in o.outputs]
    return time.perf_counter() - start, time.process_time() - cpu, hyps


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(ta == tb and abs(sa - sb) < 1e-3 for (ta, sa), (tb, sb) in zip(a, b)) and len(a) == len(b)


def main() -> None:
    from plyx.serve import BeamSearchParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--prompts", default="1,8", help="prompts per call (each a beam group)")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
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
    params = BeamSearchParams(num_beams=args.beams, max_new_tokens=args.new_tokens, num_return_sequences=args.beams,
                              early_stopping=True)
    rows = []
    for p in (int(x) for x in args.prompts.split(",")):
        g = torch.Generator().manual_seed(p)
        prompts = torch.randint(3, CONFIGS[args.config]["vocab_size"], (p, args.prompt_len), generator=g).tolist()
        for side in ("reference", "engine"):  # warm-up: allocator, kernels, graphs, the kept engine
            run(side, model, prompts, params)
        best: dict[str, float] = {}
        best_cpu: dict[str, float] = {}
        hyps: dict[str, list[Any]] = {}
        for _ in range(args.repeats):
            for side in ("reference", "engine"):
                s, c, h = run(side, model, prompts, params)
                best[side] = min(best.get(side, float("inf")), s)
                best_cpu[side] = min(best_cpu.get(side, float("inf")), c)
                hyps[side] = h
        n = p * args.beams * args.new_tokens  # beam-tokens decoded (no stop id: every beam runs to the limit)
        row = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device_name,
               "torch": torch.__version__, "dtype": args.dtype, "config": args.config, "prompts": p,
               "beams": args.beams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "repeats": args.repeats, "reference_s": best["reference"], "engine_s": best["engine"],
               "reference_beam_tok_s": n / best["reference"], "engine_beam_tok_s": n / best["engine"],
               "engine_over_reference": best["reference"] / best["engine"],
               "reference_cpu_s": best_cpu["reference"], "engine_cpu_s": best_cpu["engine"],
               "engine_over_reference_cpu": best_cpu["reference"] / best_cpu["engine"],
               "same_hypotheses": _same(hyps["reference"], hyps["engine"])}
        rows.append(row)
        print(f"prompts {p:3d} x {args.beams} beams  reference {row['reference_s'] * 1e3:8.1f} ms  engine "
              f"{row['engine_s'] * 1e3:8.1f} ms  engine/reference {row['engine_over_reference']:.2f} "
              f"(process time {row['engine_over_reference_cpu']:.2f})  same hypotheses {row['same_hypotheses']}",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    with open(out / f"beam-path-{kind}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
