"""Disaggregated prefill/decode vs the colocated engine: TPOT of decode-heavy requests while long prefills arrive.

One workload, served four ways by ``plyx serve``'s app on loopback (the client in its own spawned process, as in
``serving.py``): the colocated engine (prefills and decodes share its steps) and ``--disaggregate`` (a prefill
worker process computes prompts and hands their KV blocks over through the ``torch_distributed`` connector),
each once with the decode-heavy requests alone and once with long prompts arriving while they decode.

* decode-heavy: ``--decode-requests`` prompts of ``--decode-input`` tokens, ``--decode-output`` tokens each, all
  at t = 0;
* long prefills: ``--prefills`` prompts of ``--prefill-input`` tokens, ``--prefill-output`` tokens each, the
  first at ``--prefill-start`` s, then one every ``--prefill-interval`` s.

Reported per run: the decode requests' TPOT (mean, median, p99 over requests) and inter-token latency (p99,
max), the long prompts' TTFT, and TPOT with prefills over TPOT alone: disaggregation keeps it near 1, the
colocated engine's grows with every prefill chunk that shares a step with the decodes. Same random weights,
greedy, EOS ignored, one warm-up (other prompts) per server.

    python packages/serve/bench/bench_disagg.py                                  # CPU, small model
    python packages/serve/bench/bench_disagg.py --device cuda --model 1b --out $OUT   # 1 GPU shared (gloo)
    # two GPUs: the worker on cuda:1, KV device to device through NCCL
    python packages/serve/bench/bench_disagg.py --device cuda:0 --prefill-device cuda:1 --model 1b --out $OUT

On the CPU both processes get ``--threads`` torch threads: the disaggregated runs use twice the cores (as they
use two GPUs on a two-GPU machine); the colocated engine on one device is the comparison a vLLM user makes.
Results: printed, and written to ``<out>/disagg-<device>-<model>-<date>.{json,md}`` (default out:
``bench/results``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the sibling bench: its client and models
from serving import MODELS, Request, Timing, _one, build_models, spawn_client

RESULTS = Path(__file__).resolve().parent / "results"


def workloads(args: argparse.Namespace, vocab: int) -> tuple[list[Request], list[Request], list[Request]]:
    """(warm-up, decode-heavy, long prefills): random prompts, distinct so no run hits another's prefix cache."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(8, vocab) for _ in range(n)]

    decode = [Request(prompt(args.decode_input), args.decode_output, 0.0) for _ in range(args.decode_requests)]
    long = [Request(prompt(args.prefill_input), args.prefill_output, args.prefill_start + i * args.prefill_interval)
            for i in range(args.prefills)]
    warm = [Request(prompt(n), 4, 0.0) for n in (args.decode_input, args.prefill_input, 2 * args.decode_input)]
    return warm, decode, long


async def _client(url: str, warm: list[Request], reqs: list[Request], conn: Any) -> None:
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        for r in warm:  # one at a time: every shape class compiles, and the worker's first transfer happens
            await _one(client, url, r, time.perf_counter(), None)
        conn.send("warm")
        if conn.recv() != "go":
            return
        start = time.perf_counter()
        timings = await asyncio.gather(*(_one(client, url, r, start, None) for r in reqs))
        conn.send(([vars(t) for t in timings], time.perf_counter() - start))


def _client_main(url: str, warm: list[tuple[Any, ...]], reqs: list[tuple[Any, ...]], conn: Any) -> None:
    try:
        asyncio.run(_client(url, [Request(*r) for r in warm], [Request(*r) for r in reqs], conn))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def run_client(url: str, warm: list[Request], reqs: list[Request], on_warm: Any) -> tuple[list[Timing], float]:
    """Run the load from a spawned process (``serving.spawn_client``'s handshake): warm-up, then the requests."""
    return spawn_client(_client_main, (url, [(r.prompt, r.output_len, r.arrival) for r in warm],
                                       [(r.prompt, r.output_len, r.arrival) for r in reqs]), on_warm)


def _ms(xs: list[float], q: float | None = None) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    if q is None:
        return statistics.fmean(s) * 1e3
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1e3


def bench(args: argparse.Namespace, ckpt: Path, model: Any, tok: Any, warm: list[Request], decode: list[Request],
          long: list[Request], disaggregate: bool) -> dict[str, Any]:
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server import ServerSettings, create_app, serve_in_thread

    reqs = decode + long
    max_len = max(len(r.prompt) + r.output_len for r in reqs + warm)
    engine = Engine(model, tokenizer=tok, config=EngineConfig(
        max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, max_model_len=max_len, max_queue=100_000,
        mixed_chunk=16 if args.device.startswith("cuda") else 0))
    aengine = None
    if disaggregate:
        from plyx.serve.disagg import DisaggAsyncEngine, start_prefill_worker

        env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        worker = start_prefill_worker(ckpt, engine, device=args.prefill_device, dtype=args.dtype,
                                      backend=args.kv_backend, threads=args.threads, env=env,
                                      num_blocks=args.num_blocks)
        aengine = DisaggAsyncEngine(engine, worker)
    app = create_app(engine, settings=ServerSettings(model_name="bench", max_concurrent=100_000), aengine=aengine)
    aengine = app.state.plyx.aengine
    marks: dict[str, float] = {}
    cpu = [0.0]  # the engine thread's CPU seconds in Engine.step: the work of its steps, whatever else runs
    step = engine.step

    def timed_step() -> Any:
        t0 = time.thread_time()
        try:
            return step()
        finally:
            cpu[0] += time.thread_time() - t0

    engine.step = timed_step  # type: ignore[method-assign]

    def on_warm() -> None:
        marks["steps"], marks["step_s"] = engine.stats.steps, aengine.step_seconds
        marks["prompt_tokens"], marks["cpu"] = engine.stats.prompt_tokens, cpu[0]

    with serve_in_thread(app, timeout_graceful_shutdown=10) as running:
        timings, duration = run_client(running.base_url + "/v1/completions", warm, reqs, on_warm)
    dec, lng = timings[:len(decode)], timings[len(decode):]
    ok = [t for t in dec if t.ok]
    tpot = [(t.e2e - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    itl = [x for t in ok for x in t.itl]
    steps = engine.stats.steps - marks["steps"]
    return {
        "name": f"{'disaggregated' if disaggregate else 'colocated'}, {'with' if long else 'no'} long prefills",
        "disaggregated": disaggregate, "long_prefills": len(long), "duration_s": duration,
        "decode_completed": len(ok), "long_completed": sum(t.ok for t in lng),
        "tpot_ms": {"mean": _ms(tpot), "median": statistics.median(tpot) * 1e3 if tpot else float("nan"),
                    "p99": _ms(tpot, 0.99)},
        "itl_ms": {"p50": _ms(itl, 0.5), "p99": _ms(itl, 0.99), "max": _ms(itl, 1.0)},
        "long_ttft_ms": _ms([t.ttft for t in lng if t.ok]) if lng else float("nan"),
        "engine_steps": steps, "engine_step_ms": (aengine.step_seconds - marks["step_s"]) * 1e3 / max(1, steps),
        "engine_step_cpu_ms": (cpu[0] - marks["cpu"]) * 1e3 / max(1, steps),
        # prompt tokens the decode engine computed itself (disaggregated: only the tails after handed-over blocks)
        "decode_engine_prompt_tokens": engine.stats.prompt_tokens - marks["prompt_tokens"],
    }


def render(report: dict[str, Any]) -> str:
    a = report["args"]
    runs = report["runs"]
    lines = [
        f"# disaggregated prefill/decode vs colocated — {report['device']}, {report['date']}", "",
        f"model `{a['model']}` ({report['model_params'] / 1e6:.1f} M params, {a['dtype']}); decode-heavy: "
        f"{a['decode_requests']} x ({a['decode_input']} in, {a['decode_output']} out) at t=0; long prefills: "
        f"{a['prefills']} x ({a['prefill_input']} in, {a['prefill_output']} out) from {a['prefill_start']} s every "
        f"{a['prefill_interval']} s; max_batch_tokens {a['max_batch_tokens']}, block {a['block_size']}; torch "
        f"threads per process {report['torch_threads']}; prefill worker on `{report['prefill_device']}`", "",
        "| metric | " + " | ".join(r["name"] for r in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]

    def row(label: str, fn: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in runs) + " |")

    row("decode requests completed", lambda r: str(r["decode_completed"]))
    row("long prompts completed", lambda r: str(r["long_completed"]) if r["long_prefills"] else "-")
    for s in ("mean", "median", "p99"):
        row(f"decode TPOT {s} (ms)", lambda r, s=s: f"{r['tpot_ms'][s]:.1f}")
    for s in ("p50", "p99", "max"):
        row(f"decode ITL {s} (ms)", lambda r, s=s: f"{r['itl_ms'][s]:.1f}")
    row("long-prompt TTFT mean (ms)", lambda r: f"{r['long_ttft_ms']:.0f}" if r["long_prefills"] else "-")
    row("engine step mean (ms)", lambda r: f"{r['engine_step_ms']:.1f}")
    row("engine step CPU time mean (ms)", lambda r: f"{r['engine_step_cpu_ms']:.1f}")
    row("prompt tokens computed by the decode engine", lambda r: str(r["decode_engine_prompt_tokens"]))
    if a["repeats"] > 1:
        row("decode TPOT mean of every run (ms)", lambda r: ", ".join(f"{x:.1f}" for x in r["tpot_mean_ms_runs"]))
    lines += ["", "TPOT mean with long prefills / alone: " + ", ".join(
        f"{k} **{v:.2f}**" for k, v in report["tpot_ratio"].items()),
              "", "decode engine's CPU time per step with long prefills / alone (the steps' own work, free of "
              "other processes' load): " + ", ".join(f"{k} **{v:.2f}**" for k, v in report["step_cpu_ratio"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefill-device", default="auto", help="the prefill worker's (auto: a second GPU, else --device)")
    p.add_argument("--kv-backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bfloat16 on CUDA")
    p.add_argument("--model", default="small", choices=list(MODELS))
    p.add_argument("--decode-requests", type=int, default=8)
    p.add_argument("--decode-input", type=int, default=32)
    p.add_argument("--decode-output", type=int, default=128)
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--prefill-input", type=int, default=1536)
    p.add_argument("--prefill-output", type=int, default=4)
    p.add_argument("--prefill-start", type=float, default=0.3)
    p.add_argument("--prefill-interval", type=float, default=0.4)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the four configurations this many times, interleaved; the table shows the run of "
                        "median decode TPOT of each (a shared machine's load changes between runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="result directory (default: bench/results)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    warm, decode, long = workloads(args, MODELS[args.model]["vocab_size"])
    every: dict[tuple[bool, bool], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        _, model, tok = build_models(args, Path(tmp))  # the checkpoint stays on disk for the worker
        for _ in range(args.repeats):
            for disaggregate in (False, True):
                for with_long in (False, True):
                    r = bench(args, Path(tmp), model, tok, warm, decode, long if with_long else [], disaggregate)
                    print(f"{r['name']}: decode TPOT mean {r['tpot_ms']['mean']:.1f} ms, ITL max "
                          f"{r['itl_ms']['max']:.1f} ms, engine step CPU {r['engine_step_cpu_ms']:.1f} ms", flush=True)
                    every.setdefault((disaggregate, with_long), []).append(r)
    runs = []
    for group in every.values():  # the run of median TPOT, with every run's TPOT beside it
        group.sort(key=lambda r: r["tpot_ms"]["mean"])
        runs.append({**group[len(group) // 2], "tpot_mean_ms_runs": [r["tpot_ms"]["mean"] for r in group]})
    def pick(d: bool, long_: bool, key: str) -> float:
        r = next(r for r in runs if r["disaggregated"] == d and bool(r["long_prefills"]) == long_)
        return r["tpot_ms"]["mean"] if key == "tpot" else r["engine_step_cpu_ms"]

    ratio = {("disaggregated" if d else "colocated"): pick(d, True, "tpot") / pick(d, False, "tpot")
             for d in (False, True)}
    cpu_ratio = {("disaggregated" if d else "colocated"): pick(d, True, "cpu") / pick(d, False, "cpu")
                 for d in (False, True)}
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    prefill_device = args.prefill_device
    if prefill_device == "auto":
        two = args.device.startswith("cuda") and torch.cuda.device_count() > 1
        prefill_device = "cuda:1" if two else args.device
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
              "prefill_device": prefill_device, "torch_threads": torch.get_num_threads(), "args": vars(args),
              "model_params": sum(x.numel() for x in model.parameters()), "runs": runs, "tpot_ratio": ratio,
              "step_cpu_ratio": cpu_ratio}
    text = render(report)
    print(text)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = f"disagg-{args.device.split(':')[0]}-{args.model}-{dt.date.today().isoformat()}"
    for suffix, body in ((".json", json.dumps(report, indent=2)), (".md", text + "\n")):
        tmp_file = out / f".{stem}{suffix}.tmp"
        tmp_file.write_text(body)
        tmp_file.replace(out / f"{stem}{suffix}")  # atomic: no half-written result
    return 0


if __name__ == "__main__":
    sys.exit(main())
