"""Shared fixtures of plyx-dist's tests: a tiny corpus, its shards, a tiny run config and launchers.

Multi-process runs are real: ``plyx train CONFIG --nproc N`` (torch.distributed.run in the
command itself) or ``python -m torch.distributed.run ... -m plyx.specs train CONFIG``, gloo on
CPU. The model is 2 layers of width 32 and runs are 6 steps, so a 2-rank run costs about the
startup of three Python processes importing torch.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from plyx.specs import DataConfig, DistConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig

WORDS = ("the king and queen of the realm spoke to their people about war and peace "
         "honour love death night day sword crown bread wine river stone").split()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLYX_DATA_DIR", str(tmp_path_factory.mktemp("plyx-data-cache")))


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prepared shards of a 120-paragraph corpus (a 300-token BPE, 20% validation)."""
    from plyx.train import prepare_corpus

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    paragraphs = [f"SPEAKER {i % 7}:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))).capitalize()
                  for i in range(120)]
    (root / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    prepare_corpus(root / "corpus.txt", root / "data", vocab_size=300, val_fraction=0.2, separator="\n\n",
                   use_hooks=False)
    return root / "data"


def tiny_config(data: Path, out: Path, *, batch_size: int, grad_accum: int = 1, dist: dict[str, Any] | None = None,
                steps: int = 6, checkpoint_every: int = 2) -> TrainConfig:
    """2 layers of width 32, untied head (tensor parallelism shards it), windows of 16 tokens; a loss per step."""
    return TrainConfig(
        model=ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32,
                          tie_embeddings=False),
        data=DataConfig(path=str(data), seq_len=16, mode="windows", val_fraction=0.2, vocab_size=300),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=1),
        steps=steps, batch_size=batch_size, grad_accum=grad_accum, device="cpu", out_dir=str(out),
        log_every=1, eval_every=3, eval_steps=2, checkpoint_every=checkpoint_every, sample_tokens=0,
        dist=DistConfig(**(dist or {})),
    )


def write_config(config: TrainConfig, path: Path) -> Path:
    path.write_text(json.dumps(config.to_dict()), encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def plyx_train(config: Path, *args: str, nproc: int, env: dict[str, str] | None = None,
               torchrun: bool = False, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``plyx train CONFIG --nproc N`` (default) or ``torchrun --nproc-per-node N -m plyx.specs train CONFIG``."""
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "-m", "plyx.specs", "train", str(config)]
    else:
        cmd = [sys.executable, "-m", "plyx.specs", "train", str(config), "--nproc", str(nproc)]
    cmd += ["--no-progress", "--no-tensorboard", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or worker_env())
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def losses(run: Path) -> dict[int, float]:
    """step -> training loss, from the run's metrics.csv (floats written with repr: exact)."""
    import csv

    with (run / "metrics.csv").open(newline="") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh) if r.get("loss")}


def metric_rows(run: Path) -> list[dict[str, str]]:
    import csv

    with (run / "metrics.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="session")
def tools() -> Any:
    """The helpers above, for test modules (importlib mode: a conftest is not importable by name)."""
    import types

    return types.SimpleNamespace(tiny_config=tiny_config, write_config=write_config, free_port=free_port,
                                 worker_env=worker_env, plyx_train=plyx_train, losses=losses, metric_rows=metric_rows)
