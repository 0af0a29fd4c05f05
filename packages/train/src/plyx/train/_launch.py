"""``plyx train CONFIG --nproc N``: the same command on N local processes, through torch.distributed.run.

This process becomes torchrun's agent (``--standalone``: a free port, one node) and
starts N workers running ``python -m plyx.specs train ...`` with the same arguments
minus ``--nproc``. Each worker sees ``WORLD_SIZE``/``RANK``, so its Trainer asks the
``plyx_train_strategy`` hook (plyx-dist) for the ``[dist]`` strategy. Multi-node runs
use torchrun directly with its rendezvous flags::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m plyx.specs train CONFIG
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["spawn", "worker_argv", "quiet_other_ranks"]


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``plyx train`` arguments of ``args`` without ``--nproc`` (what every worker runs)."""
    argv: list[str] = [args.config] if args.config else []
    for item in args.overrides:
        argv += ["--set", item]
    for flag in ("steps", "out_dir", "device", "peak_flops"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    if args.resume is not None:
        argv += ["--resume", args.resume]
    for flag in ("overwrite", "no_progress", "no_tensorboard"):
        if getattr(args, flag, False):
            argv.append(f"--{flag.replace('_', '-')}")
    if getattr(args, "spectral_probe", 0):
        argv += ["--spectral-probe", str(args.spectral_probe)]
    return argv


def spawn(args: argparse.Namespace) -> int:
    """Run ``plyx train`` on ``args.nproc`` local processes; the exit code names the failed rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if args.nproc < 1:
        print(f"error: --nproc must be at least 1 (got {args.nproc})", file=sys.stderr)
        return 2
    launch = get_args_parser().parse_args([
        "--standalone", "--nproc-per-node", str(args.nproc), "--module", "plyx.specs", "train", *worker_argv(args),
    ])
    try:
        run(launch)
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            how = (f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}")
            print(f"error: rank {rank} failed ({how}, pid {failure.pid})", file=sys.stderr)
        return 1
    return 0


def quiet_other_ranks() -> None:
    """In a worker of a distributed run, only rank 0 prints to stdout (errors still reach stderr)."""
    if os.environ.get("RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")  # the worker process keeps it for its lifetime
