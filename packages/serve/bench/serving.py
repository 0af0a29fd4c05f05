"""Online serving benchmark of ``plyx serve``, in the style of vLLM's ``benchmarks/benchmark_serving.py``.

A fixed synthetic workload (vLLM's ``random`` dataset: input/output lengths drawn
uniformly in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``, an optional
shared prefix of ``prefix_len`` tokens, Poisson arrivals at ``request_rate``) is sent
as streaming ``/v1/completions`` requests to the server on loopback, by a client in its
own (spawned) process as vLLM's is, and reported as vLLM does: requests/s, output
tokens/s, TTFT, TPOT and ITL (mean, median, p99), once with prefix caching on and once
off, with the engine's own mean step time beside them (TPOT above it is scheduling and
the HTTP path).

The baseline is the naive way: ``transformers`` ``generate()`` on the same requests,
one static batch of ``--hf-batch`` at a time in arrival order (left padding, greedy,
each batch runs to its longest output; only each request's own tokens are counted).
Its TTFT is the time from the workload's start to the batch's first token (taken by a
streamer), its TPOT the batch's decode time per step.

Both sides use the same random Llama-shaped weights (saved by transformers, loaded by
``plyx.model.load_hf``) and greedy decoding with EOS ignored, so every request
produces exactly its output length.

    python packages/serve/bench/serving.py                          # CPU, small model
    python packages/serve/bench/serving.py --device cuda --model 1b --num-prompts 256 \\
        --max-concurrency 128 --hf-batch 32 --input-len 256 --output-len 128

Decode-heavy, against ``plyx.serve.generate`` at the same batch in the same run (``serving_vs_generate``)::

    python packages/serve/bench/serving.py --device cuda --dtype bfloat16 --model 1.1b --num-prompts 64 \\
        --max-concurrency 32 --input-len 32 --prefix-len 0 --output-len 512 --range-ratio 0 \\
        --skip-hf --skip-prefix-off --vs-generate

``--temperature T --top-p P`` samples every request instead (serving and generate's loop alike; the
transformers baseline stays greedy): the engine's sampled multi-step graphs against generate's sampled loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

#: Llama-shaped sizes (hidden, layers, heads, kv heads, ffn, vocab); "1b" is Llama-3.2-1B's shape
MODELS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=344, vocab_size=1024),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=1024),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32768),
    # the 1.1B's depth at a tiny width: host overhead per layer dominates (profile_serving's mixed-step profile)
    "deep": dict(hidden_size=64, num_hidden_layers=22, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=1024),
    # TinyLlama 1.1B's shape: the model of the GPU figures in issue 27 and of bench_generate's "1.1b"
    "1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000),
}


# -- workload -----------------------------------------------------------------------------
@dataclass
class Request:
    prompt: list[int]
    output_len: int
    arrival: float  # seconds after the start
    sampling: dict[str, float] = field(default_factory=dict)  # request body fields: temperature, top_p


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    """The requests' sampling fields (none for the default greedy run: its request bodies stay as they were)."""
    out = {}
    if getattr(args, "temperature", 0.0):
        out["temperature"] = args.temperature
    if getattr(args, "top_p", 1.0) < 1.0:
        out["top_p"] = args.top_p
    return out


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    lo_in, hi_in = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
    lo_out, hi_out = max(1, int(args.output_len * (1 - args.range_ratio))), int(args.output_len * (1 + args.range_ratio))
    prefix = [rng.randrange(8, vocab) for _ in range(args.prefix_len)]
    t, reqs = 0.0, []
    for _ in range(args.num_prompts):
        n_in = rng.randint(lo_in, hi_in)
        reqs.append(Request(prefix + [rng.randrange(8, vocab) for _ in range(n_in)], rng.randint(lo_out, hi_out), t,
                            _sampling(args)))
        if args.request_rate != float("inf"):
            t += rng.expovariate(args.request_rate)  # Poisson process
    return reqs


# -- metrics ------------------------------------------------------------------------------
@dataclass
class Timing:
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    ok: bool = False


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    s = sorted(xs)
    return {"mean": statistics.fmean(s) * 1e3, "median": statistics.median(s) * 1e3,
            "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))] * 1e3}


def summarize(name: str, reqs: list[Request], timings: list[Timing], duration: float,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    done = [t for t in timings if t.ok]
    out = sum(t.output_tokens for t in done)
    tpot = [(t.e2e - t.ttft) / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    return {
        "name": name, "completed": len(done), "failed": len(timings) - len(done), "duration_s": duration,
        "total_input_tokens": sum(len(r.prompt) for r in reqs), "total_output_tokens": out,
        "request_throughput": len(done) / duration, "output_throughput": out / duration,
        "total_token_throughput": (out + sum(len(r.prompt) for r in reqs)) / duration,
        "ttft_ms": _stats([t.ttft for t in done]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for t in done for x in t.itl]), **(extra or {}),
    }


# -- plyx: the server on loopback, the client in its own process ---------------------------
# The client (up to --num-prompts aiohttp streams parsing JSON lines; httpx where aiohttp is missing or
# PLYX_BENCH_CLIENT=httpx: its pure-Python parser admitted about 30 requests/s at 128 concurrent streams, so the
# client, not the server, set TTFT there) runs in a spawned process, as vLLM's
# benchmark_serving runs apart from the server: in the server's process it would take the GIL from the
# event loop and the engine thread at every token and add its own parsing to the measured latencies.
@contextlib.asynccontextmanager
async def _post_stream(client: Any, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[int, Any, Any]]:
    """POST ``body`` and yield ``(status, lines, read)``: the response's status, an async iterator over its
    lines and a coroutine function reading the whole body. ``client`` is an aiohttp ``ClientSession`` (as
    vLLM's benchmark_serving: its C-accelerated parser keeps up with 128+ concurrent streams, where httpx's
    pure-Python one made the client, not the server, the bottleneck) or an ``httpx.AsyncClient``."""
    if hasattr(client, "stream"):  # httpx
        async with client.stream("POST", url, json=body) as r:
            yield r.status_code, r.aiter_lines(), r.aread
    else:  # aiohttp: its content iterates lines, separators included
        async with client.post(url, json=body) as r:
            yield r.status, (raw.decode().rstrip("\r\n") async for raw in r.content), r.read


async def _one(client: Any, url: str, req: Request, start: float, sem: asyncio.Semaphore | None) -> Timing:
    await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
    timing = Timing()
    body = {"model": "bench", "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **req.sampling}
    if sem is not None:
        await sem.acquire()
    try:
        sent = last = time.perf_counter()
        async with _post_stream(client, url, body) as (status, lines, read):
            if status != 200:
                print("request failed:", status, (await read())[:200], file=sys.stderr)
                return timing
            async for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                # one chunk per token event: per token, or per up to --stream-interval tokens of a multi-step block
                # (ITL is then between chunks; TPOT and tok/s count tokens from the usage)
                if chunk["choices"]:
                    if timing.ttft == 0.0:
                        timing.ttft = now - sent
                    else:
                        timing.itl.append(now - last)
                    last = now
        timing.e2e = time.perf_counter() - sent
        timing.ok = timing.output_tokens == req.output_len
    finally:
        if sem is not None:
            sem.release()
    return timing


async def _client(url: str, reqs: list[Request], max_concurrency: int, conn: Any) -> None:
    """Warm-up, then the handshake (``"warm"`` out, ``"go"`` in), then the measured load; sends the timings."""
    try:
        import aiohttp
    except ImportError:
        aiohttp = None
    if aiohttp is not None and os.environ.get("PLYX_BENCH_CLIENT", "aiohttp") == "aiohttp":
        connector = aiohttp.TCPConnector(limit=len(reqs) + 8)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                         read_bufsize=1 << 20) as session:
            await _load(session, url, reqs, max_concurrency, conn)
        return
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await _load(client, url, reqs, max_concurrency, conn)


async def _load(client: Any, url: str, reqs: list[Request], max_concurrency: int, conn: Any) -> None:
    """The warm-up, the handshake and the measured requests (``_one`` each)."""
    # warm-up, not counted: a few short requests at once compile the kernels of every shape class
    # (prefill chunks, mixed and decode steps) and fill the allocator
    # (as many as run at once, long enough for multi-step decode blocks: every graph of the measured
    # batch size is captured here, not in the measured run)
    warm = [Request(r.prompt, 24, 0.0, r.sampling) for r in reqs[:max(16, min(len(reqs), max_concurrency or 16))]]
    await asyncio.gather(*(_one(client, url, r, time.perf_counter(), None) for r in warm))
    conn.send("warm")
    if conn.recv() != "go":  # the server side resets its prefix cache and counters meanwhile
        return
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    timings = await asyncio.gather(*(_one(client, url, r, start, sem) for r in reqs))
    conn.send(([vars(t) for t in timings], time.perf_counter() - start))


def _client_main(url: str, reqs: list[tuple[Any, ...]], max_concurrency: int, conn: Any) -> None:
    """The client process's entry point (module level, so that the spawn context can pickle it)."""
    try:
        asyncio.run(_client(url, [Request(*r) for r in reqs], max_concurrency, conn))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _recv(conn: Any, proc: Any, what: str) -> Any:
    """The client's next message; raises (instead of hanging) when the client process died."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the benchmark client process exited (code {proc.exitcode}) before sending {what}; "
                               "its traceback is above")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(f"the benchmark client process failed before sending {what}: {msg[1]}")
    return msg


def run_client(url: str, reqs: list[Request], max_concurrency: int, on_warm: Any) -> tuple[list[Timing], float]:
    """Run the load from a spawned process: warm-up, ``on_warm()`` here, then the measured requests."""
    return spawn_client(_client_main, (url, [(r.prompt, r.output_len, r.arrival, r.sampling) for r in reqs], max_concurrency),
                        on_warm)


def spawn_client(target: Any, args: tuple[Any, ...], on_warm: Any) -> tuple[list[Timing], float]:
    """Run ``target(*args, conn)`` in a spawned process through the client handshake: it sends ``"warm"`` after
    its warm-up, ``on_warm()`` runs here, ``"go"`` starts the measured load, and it sends back its timings."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of the server's threads, model or torch state
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, name="plyx-bench-client", daemon=True, args=(*args, child))
    proc.start()
    child.close()
    try:
        if _recv(parent, proc, "the end of the warm-up") != "warm":
            raise RuntimeError("the benchmark client broke the handshake (expected 'warm')")
        on_warm()
        parent.send("go")
        raw, duration = _recv(parent, proc, "its timings")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        parent.close()
    return [Timing(**t) for t in raw], duration


class StepTrace:
    """Per engine step: wall ms, decode rows, prefill tokens and how it ran (``--step-trace``).

    Wraps ``engine.step`` on the instance (the engine thread calls it), reading the engine's counters
    around each call: prefill tokens are the step's computed prompt tokens; decode rows are the step's
    other fed tokens (one each without speculation) plus rows sampled from a look-ahead forward. A step
    is ``mixed-graph`` / ``decode-graph`` when a mixed-step / decode graph was replayed, else ``eager``.
    ``tokens`` are the tokens the step emitted, ``steps`` the decode steps it ran (k for a multi-step block),
    ``wait_ms`` how long the engine thread waited for the device to read a block's tokens back.
    ``step_trace_report.py`` splits a trace's wall time by kind of step and into waves.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rows: list[dict[str, Any]] = []
        self._step = engine.step
        self._t0 = time.perf_counter()
        engine.step = self._traced
        # CUDA: each multi-step block's replay bracketed by timing events, so the summary can say how long the
        # device computed a block and how long it sat idle between two (host-bound) blocks
        self.replay_events: list[tuple[Any, Any]] = []
        graphs = getattr(engine, "graphs", None)
        if engine.device.type == "cuda" and graphs is not None and hasattr(graphs, "greedy_steps"):
            replay = graphs.greedy_steps

            def timed_replay(*args: Any, **kwargs: Any) -> Any:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = replay(*args, **kwargs)
                end.record()
                self.replay_events.append((start, end))
                return out

            graphs.greedy_steps = timed_replay

    def reset(self) -> None:
        self.rows.clear()
        self.replay_events.clear()
        self._t0 = time.perf_counter()

    def device_blocks(self) -> dict[str, float]:
        """Device ms of each block replay and device idle ms between consecutive replays (medians and totals)."""
        if not self.replay_events:
            return {}
        torch.cuda.synchronize()
        busy = [a.elapsed_time(b) for a, b in self.replay_events]
        idle = [b.elapsed_time(a2) for (_, b), (a2, _) in zip(self.replay_events, self.replay_events[1:])]
        return {"blocks": len(busy), "block_device_ms_median": statistics.median(busy),
                "block_device_ms_total": sum(busy), "idle_between_ms_median": statistics.median(idle) if idle else 0.0,
                "idle_between_ms_total": sum(idle)}

    def _replays(self) -> tuple[int, int]:
        e = self.engine
        mixed, decode = getattr(e, "mixed_graphs", None), e.graphs
        return (mixed.replays if mixed is not None else 0), (decode.replays if decode is not None else 0)

    def _traced(self) -> Any:
        st = self.engine.stats
        steps, prompt, ahead, emitted = st.steps, st.prompt_tokens, st.looked_ahead, st.generated_tokens
        mixed, decode = self._replays()
        waited = self._waited()
        t = time.perf_counter()
        out = self._step()
        wall = time.perf_counter() - t
        if st.steps == steps:
            return out  # nothing was scheduled
        prefill = st.prompt_tokens - prompt
        m, d = self._replays()
        kind = "mixed-graph" if m > mixed else "decode-graph" if d > decode else "eager"
        self.rows.append({"t_s": round(t - self._t0, 6), "wall_ms": round(wall * 1e3, 3),
                          "decode_rows": st.last_batch_tokens - prefill + (st.looked_ahead - ahead),
                          "prefill_tokens": prefill, "batch_seqs": st.last_batch_seqs, "path": kind,
                          # what the step emitted and how many decode steps it ran (a multi-step block: k)
                          "tokens": st.generated_tokens - emitted, "steps": st.steps - steps})
        if self.engine.device.type == "cuda":
            # ms the engine thread waited for the device to read a block back: ~0 when the host is the
            # bottleneck, ~the block's device time when the device is (CPU: the forward runs inline, no wait)
            self.rows[-1]["wait_ms"] = round((self._waited() - waited) * 1e3, 3)
        return out

    def _waited(self) -> float:
        reader = getattr(self.engine, "_block_reader", None)  # (serve >= 1.7, CUDA: multi-step block reads)
        return float(getattr(reader, "wait_s", 0.0))

    def summary(self) -> dict[str, Any]:
        """Mean wall ms of mixed steps (a prefill chunk on board) and of decode-only steps; step counts by path."""
        mixed = [r["wall_ms"] for r in self.rows if r["prefill_tokens"]]
        decode = [r["wall_ms"] for r in self.rows if not r["prefill_tokens"]]
        paths: dict[str, int] = {}
        for r in self.rows:
            paths[r["path"]] = paths.get(r["path"], 0) + 1
        out = {"steps": len(self.rows), "mixed_steps": len(mixed), "decode_steps": len(decode),
               "mixed_step_ms": statistics.fmean(mixed) if mixed else 0.0,
               "decode_step_ms": statistics.fmean(decode) if decode else 0.0,
               "mixed_ms_total": sum(mixed), "decode_ms_total": sum(decode), "paths": paths}
        if self.replay_events:
            out["device_blocks"] = self.device_blocks()
        if self.rows:
            from step_trace_report import analyse

            out["where"] = analyse(self.rows)
        return out

    def write(self, path: str | Path) -> Path:
        """The trace as JSON lines (one step each), then the summary as the last line; written atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        lines = [json.dumps(r) for r in self.rows] + [json.dumps({"summary": self.summary()})]
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
        return path


def bench_plyx(model: Any, tokenizer: Any, reqs: list[Request], args: argparse.Namespace, prefix_caching: bool,
               packed: bool = True, trace: str = "") -> dict[str, Any]:
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server import ServerSettings, create_app, serve_in_thread

    max_len = max(len(r.prompt) + r.output_len for r in reqs)
    # (an engine before multi-step decode has no decode_steps: the script measures it too)
    multi = {"decode_steps": args.decode_steps or None} if "decode_steps" in EngineConfig.__struct_fields__ else {}
    if args.stream_interval is not None:  # (an engine before serve 1.7 has no stream_interval)
        multi["stream_interval"] = args.stream_interval
    engine = Engine(model, tokenizer=tokenizer, config=EngineConfig(
        max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, max_model_len=max_len, prefix_caching=prefix_caching, max_queue=100_000,
        packed_step=packed, cuda_graphs=not args.no_graphs, mixed_graphs=False if args.no_mixed_graphs else None,
        **multi,

        mixed_chunk=(16 if args.device.startswith("cuda") else 0) if args.mixed_chunk < 0 else args.mixed_chunk))
    app = create_app(engine, settings=ServerSettings(model_name="bench", max_concurrent=100_000,
                                                     switch_interval=args.switch_interval))
    marks: dict[str, int] = {}
    tracer = StepTrace(engine) if trace else None

    def on_warm() -> None:  # between warm-up and measured run; the engine thread is idle by then
        if tracer is not None:
            tracer.reset()
        if engine.prefix is not None:
            engine.prefix.clear()  # the measured run starts with an empty prefix cache
            marks["hits"], marks["queried"] = engine.prefix.hit_tokens, engine.prefix.queried_tokens
        marks["preemptions"] = engine.stats.preemptions
        marks["steps"] = engine.stats.steps
        marks["blocks"] = getattr(engine.stats, "multi_step_blocks", 0)
        marks["step_s"] = aengine.step_seconds
        marks["cpu_s"] = time.process_time()  # the server's CPU seconds (engine thread + event loop)

    aengine = app.state.plyx.aengine
    with serve_in_thread(app) as running:
        timings, duration = run_client(running.base_url + "/v1/completions", reqs, args.max_concurrency, on_warm)
    cpu_s = time.process_time() - marks["cpu_s"]
    p = engine.prefix
    extra = {"server_cpu_s": cpu_s,  # on a shared machine, wall times carry other processes' turns; this does not
             "prefix_caching": prefix_caching, "packed_step": engine.packed, "preemptions": engine.stats.preemptions - marks["preemptions"],
             "engine_steps": engine.stats.steps - marks["steps"],
             # the engine's own time per step (the thread's wall time in Engine.step): TPOT above it is the
             # scheduling of requests and the HTTP path
             "engine_step_ms": (aengine.step_seconds - marks["step_s"]) * 1e3 / max(1, engine.stats.steps - marks["steps"]),
             "prefix_hit_rate": (p.hit_tokens - marks["hits"]) / max(1, p.queried_tokens - marks["queried"])
             if p is not None else 0.0}
    mg = getattr(engine, "mixed_graphs", None)
    extra["mixed_graphs"] = mg is not None and mg.capture
    if mg is not None:
        extra["mixed_graph_warmup_s"] = mg.warmup_s
    if tracer is not None:
        extra["step_trace"] = tracer.summary()
        print(f"step trace: {tracer.write(trace)}")
        t = extra["step_trace"]
        print(f"engine steps {t['steps']}: mixed-step mean {t['mixed_step_ms']:.2f} ms ({t['mixed_steps']} steps, "
              f"{t['mixed_ms_total']:.0f} ms), decode-only-step mean {t['decode_step_ms']:.2f} ms ({t['decode_steps']} "
              f"steps, {t['decode_ms_total']:.0f} ms), by path {t['paths']}")
        if t.get("device_blocks"):
            d = t["device_blocks"]
            print(f"multi-step block replays {d['blocks']}: device {d['block_device_ms_median']:.2f} ms median "
                  f"({d['block_device_ms_total']:.0f} ms in all), device idle between two "
                  f"{d['idle_between_ms_median']:.2f} ms median ({d['idle_between_ms_total']:.0f} ms in all)")
    step = "" if packed else ", one forward per group"
    step += f", decode_steps {getattr(engine, 'decode_steps', 1)}"
    if hasattr(engine.config, "stream_interval"):
        step += f", stream_interval {engine.config.stream_interval}"
    extra["multi_step_blocks"] = getattr(engine.stats, "multi_step_blocks", 0) - marks["blocks"]
    return summarize(f"plyx serve (prefix caching {'on' if prefix_caching else 'off'}{step})", reqs, timings,
                     duration, extra)


# -- baseline: transformers generate, one static batch at a time --------------------------
class _FirstToken:
    """A ``generate`` streamer that notes when the first new token of the batch exists."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def bench_hf(hf: Any, reqs: list[Request], args: argparse.Namespace, device: str) -> dict[str, Any]:
    timings = [Timing() for _ in reqs]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    with torch.inference_mode():  # warm-up
        hf.generate(torch.tensor([reqs[0].prompt[:8]], device=device), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)
    start = time.perf_counter()
    for b in range(0, len(order), args.hf_batch):
        idx = order[b:b + args.hf_batch]
        # a static batch starts once all its requests have arrived
        time.sleep(max(0.0, start + max(reqs[i].arrival for i in idx) - time.perf_counter()))
        width = max(len(reqs[i].prompt) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # left padding, as decoder-only generation needs
            ids[row, width - len(reqs[i].prompt):] = torch.tensor(reqs[i].prompt)
            mask[row, width - len(reqs[i].prompt):] = 1
        new = max(reqs[i].output_len for i in idx)
        streamer = _FirstToken()
        with torch.inference_mode():
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0, streamer=streamer)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = time.perf_counter()
        first = streamer.first or end
        step = (end - first) / max(1, new - 1)
        for i in idx:
            t = timings[i]
            t.ttft = first - (start + reqs[i].arrival)
            t.output_tokens = reqs[i].output_len
            t.e2e = t.ttft + step * (t.output_tokens - 1)  # its own last token, as a stream would deliver it
            t.itl = [step] * (t.output_tokens - 1)
            t.ok = True
    duration = time.perf_counter() - start
    return summarize(f"transformers generate (static batch {args.hf_batch})", reqs, timings, duration)


# -- the engine's ceiling: generate's decode at the same batch ---------------------------
def bench_generate(model: Any, reqs: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    """The static-batch graph decode loop ``generate`` ran before it became an engine client
    (``plyx.serve._reference.reference_generate``, CUDA graphs where a GPU runs it) on the same requests,
    ``--max-concurrency`` at a time in arrival order, EOS ignored: the decode speed a serving engine with as
    many requests in flight could reach. Its tokens/s is the denominator of ``serving_vs_generate`` (kept on
    the reference loop so the ratio measures the engine against the loop it replaced, not against itself)."""
    from plyx.serve import SamplingParams
    from plyx.serve._reference import reference_generate as generate

    batch = args.max_concurrency or len(reqs)
    device = next(model.parameters()).device

    def run(chunk: list[Request]) -> int:
        params = [SamplingParams(**{"temperature": 0, **r.sampling}, max_new_tokens=r.output_len, ignore_eos=True)
                  for r in chunk]
        outs = generate(model, [r.prompt for r in chunk], params)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    run(reqs[:min(len(reqs), batch)])  # warm-up: graphs captured, kernels compiled
    sync()
    timings = [Timing() for _ in reqs]
    waves = []
    start = time.perf_counter()
    for b in range(0, len(reqs), batch):
        first = time.perf_counter()
        run(reqs[b:b + batch])
        sync()
        end = time.perf_counter()
        waves.append(end - first)
        for i in range(b, min(len(reqs), b + batch)):  # a whole batch returns at once: TTFT is its end
            t = timings[i]
            t.ttft = t.e2e = end - first
            t.output_tokens = reqs[i].output_len
            t.ok = True
    duration = time.perf_counter() - start
    # after the timed run, not in it: one wave's prefill and first token alone, so the report can split a wave
    # into prefill and decode (the headline tok/s above counts both, as the serving run's does)
    chunk = reqs[:min(len(reqs), batch)]
    one = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    generate(model, [r.prompt for r in chunk], one)  # untimed: a one-token call captures graphs of its own
    sync()
    t0 = time.perf_counter()
    generate(model, [r.prompt for r in chunk], one)
    sync()
    prefill = time.perf_counter() - t0
    steps = max(r.output_len for r in chunk) - 1
    extra = {"wave_s": waves, "prefill_s": prefill,
             "decode_step_ms": (statistics.median(waves) - prefill) * 1e3 / max(1, steps)}
    return summarize(f"plyx reference decode loop (batch {batch}, no server)", reqs, timings, duration, extra)


# -- setup --------------------------------------------------------------------------------
def build_models(args: argparse.Namespace, directory: Path) -> tuple[Any, Any, Any]:
    from plyx.model import load_hf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = MODELS[args.model]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [f"w{i} x{i % 97} y{i % 13}" for i in range(4000)]
    tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=shape["vocab_size"], show_progress=False,
                                                      special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=0, pad_token_id=0)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf = LlamaForCausalLM(cfg).to(dtype).eval()
    hf.save_pretrained(directory, safe_serialization=True)
    hf = hf.to(args.device)
    plyx_model = load_hf(directory, device=args.device).eval()
    return hf, plyx_model, tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--model", default="small", choices=list(MODELS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--prefix-len", type=int, default=64, help="shared prefix (system prompt) of every request")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0: unbounded)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=0)
    p.add_argument("--mixed-chunk", type=int, default=-1, help="EngineConfig.mixed_chunk (-1: 16 on CUDA, 0 on CPU)")
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="ServerSettings.switch_interval: sys.setswitchinterval in the server (0: Python's 5 ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--compare-grouped", action="store_true",
                   help="also run the engine with one forward per group of rows (EngineConfig.packed_step=False, "
                        "the step before packing), prefix caching on: before/after in one run")
    p.add_argument("--no-graphs", action="store_true", help="EngineConfig.cuda_graphs=False (eager decode steps)")
    p.add_argument("--no-mixed-graphs", action="store_true",
                   help="EngineConfig.mixed_graphs=False (steps with a prefill chunk run the eager packed step)")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="EngineConfig.decode_steps (multi-step decode; 0: the device's default, 8 on CUDA, 1 on CPU)")
    p.add_argument("--compare-decode-steps", type=int, default=0,
                   help="also run the server with this EngineConfig.decode_steps (e.g. 1: one step per schedule)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="EngineConfig.stream_interval: tokens per streamed event of a multi-step block (default: the "
                        "engine's, 0: a row's block per event; 1: each token)")
    p.add_argument("--compare-stream-interval", type=int, default=None,
                   help="also run the server with this EngineConfig.stream_interval (e.g. 1: every token its own event)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (0: greedy); sampled requests decode through the engine's "
                        "sampled multi-step graphs")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    p.add_argument("--skip-prefix-off", action="store_true", help="skip the run with prefix caching off")
    p.add_argument("--vs-generate", action="store_true",
                   help="also time plyx generate on the same requests, --max-concurrency at a time, and report "
                        "serving output tok/s over generate's (serving_vs_generate)")
    p.add_argument("--out", default="", help="result file stem (default: results/serving-<device>-<model>-<date>); "
                   "a path with a directory writes there")
    p.add_argument("--step-trace", default="", metavar="FILE",
                   help="JSON lines of every engine step of the first measured run (wall ms, decode rows, prefill "
                        "tokens, graph or eager) and a summary line (mixed-step and decode-only-step means)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf, model, tok = build_models(args, Path(tmp))
    reqs = workload(args, MODELS[args.model]["vocab_size"])
    # an untimed pass first: one-time costs (imports, lazy module loads, kernel compiles for every shape
    # class, allocator growth) would otherwise land on whichever configuration runs first
    bench_plyx(model, tok, reqs[: min(len(reqs), 32)], args, True)
    runs = [bench_plyx(model, tok, reqs, args, True, trace=args.step_trace)]
    if not args.skip_prefix_off:
        runs.append(bench_plyx(model, tok, reqs, args, False))
    if args.compare_grouped:
        runs.append(bench_plyx(model, tok, reqs, args, True, packed=False))
    if args.compare_decode_steps:
        other = argparse.Namespace(**{**vars(args), "decode_steps": args.compare_decode_steps})
        runs.append(bench_plyx(model, tok, reqs, other, True))
    if args.compare_stream_interval is not None:
        other = argparse.Namespace(**{**vars(args), "stream_interval": args.compare_stream_interval})
        runs.append(bench_plyx(model, tok, reqs, other, True))
    extra: dict[str, Any] = {}
    if args.vs_generate:
        runs.append(bench_generate(model, reqs, args))
        extra["serving_vs_generate"] = runs[0]["output_throughput"] / runs[-1]["output_throughput"]
        extra["serving_vs_generate_runs"] = {r["name"]: r["output_throughput"] / runs[-1]["output_throughput"]
                                             for r in runs[:-1]}
    if not args.skip_hf:
        runs.append(bench_hf(hf, reqs, args, args.device))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
              "torch_threads": torch.get_num_threads(), "args": vars(args) | {"request_rate": str(args.request_rate)},
              "model_params": sum(x.numel() for x in model.parameters()), "runs": runs, **extra}
    print(render(report))
    stem = args.out or f"serving-{args.device.split(':')[0]}-{args.model}-{dt.date.today().isoformat()}"
    base = RESULTS / stem  # an absolute --out writes there
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_name(base.name + ".json").write_text(json.dumps(report, indent=2))
    base.with_name(base.name + ".md").write_text(render(report) + "\n")
    return 0


def render(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        f"# serving benchmark — {report['device']}, {report['date']}",
        "",
        f"model `{a['model']}` ({report['model_params'] / 1e6:.1f} M params, {a['dtype']}), {a['num_prompts']} "
        f"requests, input {a['input_len']}±{a['range_ratio'] * 100:.0f}% + shared prefix {a['prefix_len']}, output "
        f"{a['output_len']}±{a['range_ratio'] * 100:.0f}%, rate {a['request_rate']}/s, max concurrency "
        f"{a['max_concurrency'] or 'unbounded'}, torch threads {report['torch_threads']}",
        "",
        "| metric | " + " | ".join(r["name"] for r in report["runs"]) + " |",
        "|---" * (len(report["runs"]) + 1) + "|",
    ]

    def row(label: str, fn: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in report["runs"]) + " |")

    row("completed / failed", lambda r: f"{r['completed']} / {r['failed']}")
    row("duration (s)", lambda r: f"{r['duration_s']:.2f}")
    row("requests/s", lambda r: f"{r['request_throughput']:.2f}")
    row("output tokens/s", lambda r: f"{r['output_throughput']:.1f}")
    row("total tokens/s", lambda r: f"{r['total_token_throughput']:.1f}")
    for m in ("ttft_ms", "tpot_ms", "itl_ms"):
        for s in ("mean", "median", "p99"):
            row(f"{m[:-3].upper()} {s} (ms)", lambda r, m=m, s=s: f"{r[m][s]:.1f}")
    row("prefix-cache hit rate", lambda r: f"{r['prefix_hit_rate']:.2f}" if "prefix_hit_rate" in r else "-")
    row("preemptions", lambda r: str(r.get("preemptions", "-")))
    row("engine steps", lambda r: str(r.get("engine_steps", "-")))
    row("engine step mean (ms)", lambda r: f"{r['engine_step_ms']:.1f}" if "engine_step_ms" in r else "-")
    if any("step_trace" in r for r in report["runs"]):
        row("mixed-step mean (ms) / steps", lambda r: f"{r['step_trace']['mixed_step_ms']:.2f} / "
            f"{r['step_trace']['mixed_steps']}" if "step_trace" in r else "-")
        row("decode-only-step mean (ms) / steps", lambda r: f"{r['step_trace']['decode_step_ms']:.2f} / "
            f"{r['step_trace']['decode_steps']}" if "step_trace" in r else "-")
    if any("mixed_graph_warmup_s" in r for r in report["runs"]):
        row("mixed-graph warm-up (s)", lambda r: f"{r['mixed_graph_warmup_s']:.1f}" if "mixed_graph_warmup_s" in r
            else "-")
    row("multi-step blocks", lambda r: str(r.get("multi_step_blocks", "-")))
    row("server CPU s (engine + event loop)", lambda r: f"{r['server_cpu_s']:.2f}" if "server_cpu_s" in r else "-")
    gen = [r for r in report["runs"] if "wave_s" in r]
    if gen:
        g = gen[0]
        lines += ["", f"generate: waves of {', '.join(f'{w * 1e3:.0f}' for w in g['wave_s'])} ms back to back; "
                  f"one wave's prefill and first token alone {g['prefill_s'] * 1e3:.1f} ms; decode "
                  f"{g['decode_step_ms']:.3f} ms per step (median wave less that prefill, per step)"]
    traced = [r for r in report["runs"] if "where" in r.get("step_trace", {})]
    if traced:
        from step_trace_report import render as render_where

        lines += ["", f"where the serving run's time went ({traced[0]['name']}, from its step trace):", "",
                  render_where(traced[0]["step_trace"]["where"])]
    if "serving_vs_generate" in report:
        lines += ["", f"serving output tok/s / generate's at batch {a['max_concurrency'] or a['num_prompts']}: "
                      f"**{report['serving_vs_generate']:.2f}** (target >= 0.80)"]
        lines += [f"- {name}: {ratio:.2f}" for name, ratio in report.get("serving_vs_generate_runs", {}).items()]
        lines += ["", "Both sides count every request's output tokens over the wall time from the first request to the "
                  "last token (serving: the client's clock, HTTP included; generate: from its first batch's start, "
                  "the device synchronised at the end), prefill included on both. generate runs its waves of "
                  "--max-concurrency back to back; the serving client is closed-loop (a stream's end sends the next "
                  "request), so each wave boundary's ramp (mixed steps while requests arrive) is in the serving "
                  "figure only. That is a cost of serving, kept in the headline ratio."]
        if gen and traced:
            blocks = traced[0]["step_trace"]["where"]["by_kind"]["multi-step blocks"]
            if blocks.get("tokens") and blocks["ms"] and gen[0]["decode_step_ms"] > 0:
                mine = blocks["tokens"] / blocks["ms"] * 1e3
                theirs = (a["max_concurrency"] or a["num_prompts"]) / gen[0]["decode_step_ms"] * 1e3
                lines.append(f"Steady state (diagnostic, not the target): serving's multi-step blocks emit "
                             f"{mine:.0f} tok/s, generate's decode steps {theirs:.0f} tok/s ({mine / theirs:.2f}).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
