"""SFT -> GRPO on generated verifiable tasks; held-out accuracy after SFT, after GRPO and of a plain-SFT control.

    python packages/rl/bench/grpo_demo.py                       # the documented CPU run (minutes on 2 cores)
    python packages/rl/bench/grpo_demo.py --quick               # a smoke-sized run
    python packages/rl/bench/grpo_demo.py --device cuda         # GPU: a bigger model (512 wide, 8 layers), bf16

Appends one JSON line (device, date, torch, sizes, accuracies, GRPO metrics, timings) to
``packages/rl/bench/results/grpo_demo.jsonl`` and leaves the runs (checkpoints, metrics.jsonl) in ``--out``
(default: a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
from pathlib import Path

import attrs
import torch
from plyx.rl._demo import DemoSizes
from plyx.rl._grpo_demo import GRPODemoSizes, run_grpo_demo

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_demo.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--out", help="run directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (not for the results table)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the documented size's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-control", action="store_true", help="skip the plain-SFT control stage")
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.name}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if args.quick:
        sizes = GRPODemoSizes(base=DemoSizes(d_model=64, n_layers=2, train_tasks=800, test_tasks=100, dpo_pairs=200,
                                             pretrain_steps=60, sft_steps=60, batch_size=16, control=False,
                                             seed=args.seed),
                              grpo_prompts=200, task_tests=100, grpo_steps=10, prompts_per_step=4, num_generations=4,
                              max_new_tokens=12, control=not args.no_control)
    elif cuda:
        # the same recipe on a model 40x larger (25.3M parameters), bf16 autocast, more of everything
        sizes = GRPODemoSizes(base=DemoSizes(d_model=512, n_layers=8, n_heads=8, train_tasks=8000, test_tasks=400,
                                             dpo_pairs=2000, pretrain_steps=1500, sft_steps=600, batch_size=64,
                                             pretrain_lr=1e-3, sft_lr=3e-4, control=False, seed=args.seed),
                              grpo_prompts=2000, grpo_steps=200, prompts_per_step=32, num_generations=8, lr=3e-5,
                              control=not args.no_control, device=args.device, precision="bf16-autocast")
    else:
        sizes = GRPODemoSizes(base=DemoSizes(control=False, seed=args.seed), control=not args.no_control)
    if args.steps is not None:
        sizes = attrs.evolve(sizes, grpo_steps=args.steps)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    device = (f"cuda ({torch.cuda.get_device_name(0)})" if cuda
              else f"cpu ({platform.processor() or platform.machine()}, {args.threads} thread(s))")
    print(f"device: {device}; date: {started}; torch {torch.__version__}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plyx-rl-grpo-demo-"))
    result = run_grpo_demo(out, sizes, progress=True)
    acc = result["accuracy"]
    kinds = "/".join(sizes.grpo_kinds)
    for key, name in (("after_sft", "after SFT"), ("after_grpo", "after GRPO"),
                      ("control_sft_on_answers", "control (SFT on the GRPO prompts' answers)")):
        if key in acc:
            print(f"held-out accuracy {name}: {acc[key]['task']:.3f} on {result['task_tests']} {kinds} tasks, "
                  f"{acc[key]['accuracy']:.3f} on {result['test_tasks']} mixed tasks")
    record = {"bench": "grpo_demo", "date": started, "device": device, "torch": torch.__version__,
              "quick": args.quick, **result}
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
