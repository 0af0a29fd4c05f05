"""``compile = true``: the Trainer's model under ``torch.compile`` (Inductor) through plyx's kernels as custom ops
(plyx-kernel >= 1.3) trains to the same losses as eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plyx.train import Trainer, TrainOptions

QUIET = {"progress": False, "tensorboard": False}


def test_compile_true_trains_like_eager(tiny_config, prepared: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # hermetic: Inductor's C++ cache
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = tiny_config(prepared, tmp_path / f"run-{compiled}", steps=3, eval_every=0, checkpoint_every=0,
                          sample_tokens=0, compile=compiled, data={"mode": "packed"})
        runs[compiled] = Trainer(cfg, options=TrainOptions(**QUIET)).fit().losses
    assert len(runs[True]) == 3
    # Inductor fuses and reorders float32 arithmetic: equal up to accumulation order, over three updates
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
    assert runs[True][-1] < runs[True][0]
