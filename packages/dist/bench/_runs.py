"""Helpers of the dist benchmarks: write a TrainConfig, run ``plyx train`` (plain or ``--nproc N``), read metrics."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def prepare_data(root: Path) -> Path:
    """The bundled Tiny Shakespeare, prepared once under ``root`` (a 1024-token BPE)."""
    from plyx.train import prepare_bundled

    return Path(prepare_bundled(root / "data", vocab_size=1024))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(config: dict[str, Any], work: Path, *, nproc: int | None, peak_flops: float | None,
          timeout: float = 3600, one_rank: bool = False, kernels: Path | None = None,
          profile: tuple[Path, int, int] | None = None, async_stats: bool = False,
          clock: tuple[Path, int, int] | None = None, extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``plyx train`` on ``config`` and return its last logged metrics row.

    Args:
        nproc: ``--nproc N`` (the launcher spawns N ranks); None: no launcher.
        one_rank: a distributed run of world size 1 in the command's own process (torchrun's variables set
            in its environment): the strategy's code path without a launcher process.
        kernels: record the kernel implementations the run used into this JSON file (``_kernel_trace.py``).
        profile: ``(out, start, steps)``: ``torch.profiler`` over the ``steps`` steps after step ``start``,
            summarised into ``out`` (``_step_profile.py``; needs ``kernels``).
        async_stats: the Trainer's CUDA step on any device (``TrainOptions.async_stats``; needs ``kernels``).
        clock: ``(out, start, stop)``: wall and CPU time stamped at each step from ``start`` to ``stop``, the device
            synchronised at both ends (``_step_profile.install_clock``; needs ``kernels``).
        extra_env: more environment variables for the run.
    """
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    if kernels is not None:
        cmd = [sys.executable, str(Path(__file__).with_name("_kernel_trace.py")), str(kernels)]
        if async_stats:
            cmd += ["--async-stats"]
        if clock is not None:
            cmd += ["--clock", str(clock[0]), str(clock[1]), str(clock[2])]
        if profile is not None:
            cmd += ["--profile", str(profile[0]), str(profile[1]), str(profile[2])]
    else:
        cmd = [sys.executable, "-m", "plyx.specs"]
    cmd += ["train", str(path), "--no-progress", "--no-tensorboard", "--overwrite"]
    if nproc:
        cmd += ["--nproc", str(nproc)]
    if peak_flops:
        cmd += ["--peak-flops", str(peak_flops)]
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    if one_rank:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    env.update(extra_env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with (Path(config["out_dir"]) / "metrics.csv").open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("tokens_per_s")]
    return {k: float(v) for k, v in rows[-1].items() if v not in ("", None)}


def append(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
