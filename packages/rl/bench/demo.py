"""Pretrain -> SFT -> DPO on generated verifiable tasks, on the CPU; held-out accuracy at each stage.

    python packages/rl/bench/demo.py                   # the documented run (a few minutes on 2 cores)
    python packages/rl/bench/demo.py --quick           # a smoke-sized run

Appends one JSON line (device, date, torch, sizes, accuracies, timings) to
``packages/rl/bench/results/demo.jsonl`` and leaves the runs (checkpoints, metrics.jsonl, data
reports) in ``--out`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
from pathlib import Path

import torch
from plyx.rl._demo import DemoSizes, run_demo

RESULTS = Path(__file__).resolve().parent / "results" / "demo.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="run directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a loaded 2-core machine more threads spin and slow down)")
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (not for the results table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.name}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = DemoSizes(seed=args.seed)
    if args.quick:
        sizes = DemoSizes(d_model=64, n_layers=2, train_tasks=800, test_tasks=100, dpo_pairs=200,
                          pretrain_steps=60, sft_steps=60, dpo_steps=20, batch_size=16, control=False, seed=args.seed)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    device = f"cpu ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
    print(f"device: {device}; date: {started}; torch {torch.__version__}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plyx-rl-demo-"))
    result = run_demo(out, sizes, progress=True)
    record = {"bench": "demo", "date": started, "device": device, "torch": torch.__version__,
              "quick": args.quick, **result}
    acc = result["accuracy"]
    print(f"held-out accuracy ({result['test_tasks']} tasks): before SFT {acc['before_sft']['accuracy']:.3f}, "
          f"after SFT {acc['after_sft']['accuracy']:.3f}, after DPO {acc['after_dpo']['accuracy']:.3f}"
          + (f"; control (SFT on the chosen answers) {acc['control_sft_on_chosen']['accuracy']:.3f}"
             if "control_sft_on_chosen" in acc else ""))
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
