"""Startup cost of the ``plyx`` command and of the first kernel lookup, with every installed plane.

    python packages/specs/bench/bench_startup.py            # median of 5 fresh processes each
    python packages/specs/bench/bench_startup.py --runs 9 --out packages/specs/bench/results

Scenarios (targets from the issue that asked for this benchmark):

- ``plyx --help``: <= 300 ms wall, a fresh interpreter each time;
- ``plyx plugins``: <= 400 ms;
- the first ``registry().get`` after ``import torch`` (in-process, the call
  alone: the plugin scan, every registration hook and the selection): <= 50 ms.
  ``import torch`` leaves its first full garbage collection to whatever code
  allocates next; it is paid (``gc.collect()``) before timing, and a second
  line reports the call with that collection falling inside it. Also reported:
  the call with ``from plyx.kernel import registry`` included, and the bare
  interpreter's start (``python -c pass``), the floor of the first two.

Also reported, without a target: whether torch was imported by the first two
(it must not be). Each run appends one JSON line per scenario to
``results/startup.jsonl`` (machine, date, Python, planes installed, every
sample, the median, the target and whether it was met) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: scenario -> (code run in a fresh interpreter that prints its own timing in ms or None, target in ms)
CLI = """
import sys
from plyx.specs.cli import main
sys.argv = ['plyx', *{args!r}]
try:
    main(sys.argv[1:])
except SystemExit:  # --help exits; the torch check below must still run
    pass
"""
FIRST_GET = """
import gc, time, torch
if {paid}:
    gc.collect()
t0 = time.perf_counter()
from plyx.kernel import registry
x, w = torch.randn(4, 64), torch.ones(64)
t1 = time.perf_counter()
fn = registry().get("rmsnorm", x, w)
t2 = time.perf_counter()
print("PLYX_BENCH_MS", (t2 - t1) * 1e3 if {get_only} else (t2 - t0) * 1e3)
"""
SCENARIOS: dict[str, tuple[str, float | None]] = {
    "python -c pass (interpreter floor)": ("pass", None),
    "plyx --help": (CLI.format(args=["--help"]), 300.0),
    "plyx plugins": (CLI.format(args=["plugins"]), 400.0),
    # the call itself: the plugin scan, every registration hook and the selection. torch's import leaves
    # its first full garbage collection (~200 ms here, a walk over millions of objects) to whichever code
    # allocates next; it is paid before timing here and reported separately below
    "first registry().get after import torch": (FIRST_GET.format(paid=True, get_only=True), 50.0),
    "  the same, torch's first full GC falling inside": (FIRST_GET.format(paid=False, get_only=True), None),
    "  import plyx.kernel + first get": (FIRST_GET.format(paid=True, get_only=False), None),
}
TORCH_CHECK = "\nimport sys as _s; print('PLYX_BENCH_TORCH', 'torch' in _s.modules)"


def _run_once(code: str) -> tuple[float, bool]:
    """Wall time of a fresh interpreter running ``code`` (or the time it reports), and whether torch was imported."""
    env = dict(os.environ)  # bytecode caches as users have them (written by the warm-up run)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code + TORCH_CHECK], capture_output=True, text=True, env=env,
                          timeout=300)
    wall = (time.perf_counter() - start) * 1e3
    if proc.returncode not in (0, 2):  # `plyx --help` exits through SystemExit(0)
        raise RuntimeError(f"benchmark process failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    reported = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PLYX_BENCH_MS ")]
    torch_loaded = any(line == "PLYX_BENCH_TORCH True" for line in proc.stdout.splitlines())
    return (float(reported[0]) if reported else wall), torch_loaded


def _planes() -> list[str]:
    names = sorted({d.metadata["Name"] for d in metadata.distributions() if (d.metadata["Name"] or "").startswith("plyx-")})
    return [f"{n} {metadata.version(n)}" for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per scenario (median reported)")
    parser.add_argument("--out", default=str(HERE / "results"), help="directory of startup.jsonl")
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on every platform
        load = None
    rows = []
    _run_once("pass")  # warm the file cache once, not counted
    for name, (code, target) in SCENARIOS.items():
        samples, torch_flags = [], []
        for i in range(args.runs):
            print(f"\r{name}: run {i + 1}/{args.runs}", end="", file=sys.stderr, flush=True)
            ms, loaded = _run_once(code)
            samples.append(round(ms, 1))
            torch_flags.append(loaded)
        print(file=sys.stderr)
        median = statistics.median(samples)
        rows.append({"scenario": name, "median_ms": round(median, 1), "target_ms": target,
                     "met": None if target is None else median <= target,
                     "samples_ms": samples, "imports_torch": any(torch_flags), "date": stamp, "load_avg_1m": load,
                     **machine, "planes": _planes()})
    floor = rows[0]["median_ms"]
    for row in rows[1:3]:  # the CLI scenarios start an interpreter too: what plyx adds on top of it
        row["above_floor_ms"] = round(row["median_ms"] - floor, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "startup.jsonl").open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"{stamp}  {machine['processor']} x{machine['cpus']}  Python {machine['python']}  "
          f"load {load if load is None else round(load, 2)}  {len(rows[0]['planes'])} plyx distributions")
    for row in rows:
        target = "    -   " if row["target_ms"] is None else f"{row['target_ms']:>5.0f} ms"
        verdict = "" if row["met"] is None else ("met   " if row["met"] else "MISSED")
        above = f"  ({row['above_floor_ms']:.0f} ms above the floor)" if "above_floor_ms" in row else ""
        print(f"  {row['scenario']:<50} median {row['median_ms']:>7.1f} ms  target {target}  {verdict:<6}  "
              f"torch imported: {row['imports_torch']}  samples {row['samples_ms']}{above}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
