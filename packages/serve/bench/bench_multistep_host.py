"""The host side of multi-step decode alone: a decode-heavy batch through ``Engine.step`` with a real tokenizer.

``--batch`` requests of ``--input-len`` random tokens, each decoding ``--output-len`` tokens (greedy, EOS
ignored; sampled and seeded with ``--temperature``), in an engine with ``EngineConfig.decode_steps = --decode-steps``, stepped to the end; a model so
small (the ``tiny`` shape) that the forward is a small share of the time, so what is measured is the engine's
host work per token: scheduling, reading blocks back, accepting tokens, detokenising, building the outputs
the server streams. Reported: process CPU seconds per run (the machine's other jobs do not count in it),
engine outputs (events a server streams) per run, and CPU microseconds per emitted token; best and median of
``--repeats``.

Two host costs per multi-step block are reported on their own (what keeps the device idle between blocks on a
GPU, where the forward is a graph replay): ``accept_ms_per_block``, the engine thread's process CPU time in
``accept_block`` per block (accepting each row's tokens, detokenising, building the outputs); and
``loop_ms_per_block``, the server's event loop per block: one ``EngineOutput`` per row delivered as the engine
thread delivers them (one ``_push_all`` per block) through ``RequestStream``, ``Job`` and the server's SSE
formatting (``_stream``) of ``--batch`` streaming completions (no sockets: what uvicorn adds is not counted).

Compare two trees on one machine by alternating runs of this script with ``PYTHONPATH`` set to each tree's
``packages/serve/src``; ``--stream-interval`` sets ``EngineConfig.stream_interval`` (serve >= 1.7).

    python packages/serve/bench/bench_multistep_host.py --repeats 5
"""

from __future__ import annotations

import argparse
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
from serving import build_models  # (the serving benchmark's random Llama weights and BPE tokenizer)


def run_once(model, tok, args: argparse.Namespace) -> tuple[float, int, int, float]:
    """One engine run to completion: (process CPU s, outputs, tokens, accept_block CPU ms per block)."""
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, 1000) for _ in range(args.input_len)] for _ in range(args.batch)]
    # 0: the engine's default (serve >= 1.7: one event per row and block; 1.6 had no such field)
    extra = {"stream_interval": args.stream_interval} if args.stream_interval > 0 else {}
    engine = Engine(model, tokenizer=tok, config=EngineConfig(
        max_batch_size=args.batch, max_batch_tokens=max(512, args.batch * args.input_len), block_size=16,
        max_model_len=args.input_len + args.output_len, prefix_caching=False, decode_steps=args.decode_steps,
        **extra))
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k} \
        if getattr(args, "temperature", 0.0) else {"temperature": 0.0}
    for i, p in enumerate(prompts):  # sampled rows seeded (seed + row): each run draws the same tokens
        params = SamplingParams(**sampling, seed=args.seed * 1000 + i if sampling["temperature"] else None,
                                max_new_tokens=args.output_len, ignore_eos=True)
        engine.add_request(f"r{i}", p, params)
    outputs = 0
    from plyx.serve.engine import _multistep

    accept, spent = _multistep.accept_block, [0.0, 0]

    def timed(*a: Any, **kw: Any) -> Any:  # the module global run_block and accept_ahead call
        t = time.process_time()
        out = accept(*a, **kw)
        spent[0] += time.process_time() - t
        spent[1] += 1
        return out

    _multistep.accept_block = timed
    start = time.process_time()
    try:
        while engine.has_unfinished():
            outputs += len(engine.step())
    finally:
        _multistep.accept_block = accept
    cpu = time.process_time() - start
    return cpu, outputs, engine.stats.generated_tokens, spent[0] / max(1, spent[1]) * 1e3


def loop_block_ms(batch: int, k: int, blocks: int = 100) -> float:
    """The server's event-loop CPU ms per block: ``batch`` streaming completions, each block one event of ``k``
    tokens per row pushed as the engine thread pushes them, read and formatted as SSE chunks (median block)."""
    import asyncio
    from types import SimpleNamespace

    from plyx.serve import SamplingParams, StreamEvent
    from plyx.serve.engine import EngineOutput, RequestStream
    from plyx.serve.engine._async import _push_all
    from plyx.serve.server import _app
    from plyx.serve.server._generation import Job

    text = "the text of one row's block, some sixty characters of it ..."

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        state = SimpleNamespace(tokenizer=None, settings=SimpleNamespace(model_name="bench"))
        streams, jobs = [], []
        for _ in range(batch):
            job = Job(None, [[1, 2, 3]], SamplingParams(max_new_tokens=k * blocks), None, "completion")  # type: ignore[arg-type]
            stream = RequestStream(f"{job.id}-0", loop)
            job.streams = [stream]
            streams.append(stream)
            jobs.append(job)
        got, done = [0], [loop.create_future()]

        async def consume(job: Job) -> None:
            async for _chunk in _app._stream(state, job, "completion", False, lambda status: None):
                got[0] += 1
                if got[0] == batch and not done[0].done():
                    done[0].set_result(None)

        tasks = [asyncio.create_task(consume(j)) for j in jobs]
        await asyncio.sleep(0)
        times = []
        for b in range(blocks):
            last = b == blocks - 1
            pushed = [(s, [EngineOutput(s.request_id, 0, StreamEvent(
                request_index=0, index=0, token_ids=tuple(range(k)), text=text,
                finish_reason="length" if last else None), request_finished=last)]) for s in streams]
            got[0], done[0] = 0, loop.create_future()
            t = time.process_time()
            loop.call_soon(_push_all, pushed)
            await done[0]
            times.append(time.process_time() - t)
        await asyncio.gather(*tasks)
        return times

    return statistics.median(asyncio.run(main())[blocks // 10:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--stream-interval", type=int, default=0,
                   help="EngineConfig.stream_interval (serve >= 1.7; 0: the engine default, one event per block)")
    p.add_argument("--temperature", type=float, default=0.0, help="every row's temperature (0: greedy rows)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="append the result as a JSON line to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ns = argparse.Namespace(model=args.model, dtype="float32", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        _, model, tok = build_models(ns, Path(tmp))
    run_once(model, tok, argparse.Namespace(**{**vars(args), "output_len": 8}))  # warm-up (imports, allocator)
    runs = [run_once(model, tok, args) for _ in range(args.repeats)]
    cpu = [r[0] for r in runs]
    accept_ms = statistics.median(r[3] for r in runs)
    loop_ms = statistics.median(loop_block_ms(args.batch, args.decode_steps) for _ in range(args.repeats))
    outputs, tokens = runs[0][1], runs[0][2]
    import plyx.serve

    result = {"serve": str(Path(plyx.serve.__file__).parent), "batch": args.batch, "output_len": args.output_len,
              "decode_steps": args.decode_steps, "stream_interval": args.stream_interval,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "device": "cpu", "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu_s_best": min(cpu),
              "cpu_s_median": statistics.median(cpu),
              "outputs": outputs, "tokens": tokens, "cpu_us_per_token_best": min(cpu) / tokens * 1e6,
              "accept_ms_per_block": accept_ms, "loop_ms_per_block": loop_ms}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
