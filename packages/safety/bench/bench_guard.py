"""Latency of the guardrails: input rails per prompt, detectors per long text, output rails per streamed chunk.

Run: ``PLYX_PLUGINS=safety python packages/safety/bench/bench_guard.py``; one JSON line per
measurement is appended to ``bench/results/guard.jsonl`` (sizes are the SIZES table below).
"""

from __future__ import annotations

import json
import platform
import random
import time
from pathlib import Path

from plyx.safety import Guard, build_detector

SIZES = {"prompt_chars": 500, "long_chars": 20_000, "stream_chars": 3_000, "chunk_chars": 4, "repeats": 20}
RESULTS = Path(__file__).parent / "results" / "guard.jsonl"


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ("the model returns a list of values you can parse with python and then store in the "
             "database before the next request arrives for the user").split()
    out = []
    while sum(map(len, out)) + len(out) < n:
        out.append(rng.choice(words))
    return " ".join(out)[:n]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (regex compilation, plugin scan)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    guard = Guard("builtin:default")
    prompt = _text(SIZES["prompt_chars"], 0)
    long = _text(SIZES["long_chars"], 1)
    reply = _text(SIZES["stream_chars"], 2)
    step = SIZES["chunk_chars"]
    rows = [{"name": "input_rails_default_policy", "chars": len(prompt),
             "ms": 1e3 * _time(lambda: guard.check_input(prompt), SIZES["repeats"] * 10)}]
    for name in ("prompt_injection", "pii", "deny_list"):
        det = build_detector(name, {"deny": ["idiot", "kill yourself"]} if name == "deny_list" else {})
        rows.append({"name": f"detector_{name}", "chars": len(long), "ms": 1e3 * _time(lambda d=det: d.detect(long, {}),
                                                                                       SIZES["repeats"])})

    def stream() -> None:
        f = guard.stream({})
        for i in range(0, len(reply), step):
            f.feed(reply[i:i + step])
        f.finish()

    per_stream = _time(stream, SIZES["repeats"] // 4)
    chunks = -(-len(reply) // step)
    rows.append({"name": "output_rails_stream", "chars": len(reply), "chunk_chars": step,
                 "ms": 1e3 * per_stream, "us_per_chunk": 1e6 * per_stream / chunks})
    RESULTS.parent.mkdir(exist_ok=True)
    stamp = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
             "python": platform.python_version()}
    with RESULTS.open("a") as fh:
        for row in rows:
            fh.write(json.dumps({**stamp, **row}) + "\n")
            print(f"{row['name']:<32} {row['chars']:>6} chars  {row['ms']:8.2f} ms"
                  + (f"  ({row['us_per_chunk']:.0f} us/chunk)" if "us_per_chunk" in row else ""))


if __name__ == "__main__":
    main()
