"""Resume after a crash mid-save: leftovers removed, ``latest`` repaired, missed hooks re-run, resume still exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import Trainer, TrainOptions
from safetensors.torch import load_file

QUIET = {"progress": False, "tensorboard": False, "handle_signals": False}


class _Saved:
    """Records ``plyx_on_checkpoint_saved`` like plyx-governance's receipt writer would see it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, dict[str, Any]]] = []

    @hookimpl
    def plyx_on_checkpoint_saved(self, path: str, step: int, metadata: dict) -> None:
        self.calls.append((step, path, metadata))


class _Stop:
    """Sends this process SIGTERM at the end of step ``at`` (the Trainer checkpoints and stops)."""

    def __init__(self, at: int) -> None:
        self.at = at

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict) -> None:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _dead_pid() -> int:
    """The id of a process that has exited (its leftovers are safe to remove)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _crash_leftovers(ckpts: Path) -> list[Path]:
    """What a kill during the save of step 12 (after step 8 was saved but before its hook ran) leaves."""
    pid = _dead_pid()
    tmp = ckpts / f".tmp-step-000012-{pid}"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 1024)
    old = ckpts / f".old-step-000004-{pid}"
    old.mkdir()
    link = ckpts / f".latest-{pid}"
    link.symlink_to("step-000012")
    (ckpts / "latest").unlink()
    (ckpts / "latest").symlink_to("step-000004")  # lags the newest complete checkpoint
    (ckpts / ".hooked-step-000008").unlink()  # the kill came between the rename and the hook
    (ckpts / ".hooked-step-000002").touch()  # a marker whose checkpoint was rotated away
    return [tmp, old, link, ckpts / ".hooked-step-000002"]


def test_resume_cleans_crash_leftovers_and_stays_exact(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "straight", steps=12, checkpoint_every=4, eval_every=0)
    straight = Trainer(cfg, options=TrainOptions(**QUIET)).fit()

    crashed = cfg.replace(out_dir=str(tmp_path / "crashed"))
    stop = _Stop(at=8)
    register_plugin(stop, "test-recovery-stop")
    try:  # the same 12-step run (same schedule), stopped by SIGTERM after step 8 and its checkpoint
        first = Trainer(crashed, options=TrainOptions(**{**QUIET, "handle_signals": True})).fit()
    finally:
        unregister_plugin("test-recovery-stop")
    assert first.stopped == "SIGTERM" and first.step == 8
    ckpts = tmp_path / "crashed" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob(".hooked-*")) == [".hooked-step-000004", ".hooked-step-000008"]
    leftovers = _crash_leftovers(ckpts)

    saved = _Saved()
    register_plugin(saved, "test-recovery")
    try:
        said: list[str] = []
        trainer = Trainer(crashed, options=TrainOptions(resume="auto", print_fn=said.append, **QUIET))
        rec = trainer.recovery
        assert rec is not None and sorted(rec.removed) == sorted(leftovers)
        assert not any(p.exists() or p.is_symlink() for p in leftovers)
        assert rec.latest == ckpts / "step-000008" and os.readlink(ckpts / "latest") == "step-000008"
        assert rec.unhooked == [ckpts / "step-000008"]
        assert trainer.step == 8
        second = trainer.fit()
    finally:
        unregister_plugin("test-recovery")
    # the missed hook ran first (with the checkpoint's own metadata), then the new save's
    assert [(s, Path(p).name) for s, p, _ in saved.calls] == [(8, "step-000008"), (12, "step-000012")]
    meta = saved.calls[0][2]
    assert meta["run_id"] == trainer.run_id and meta["step"] == 8 and meta["config"]["steps"] == 12
    assert meta["outputs"]["checkpoint"] == str(ckpts / "step-000008") and Path(meta["inputs"]["manifest"]).is_file()
    assert (ckpts / ".hooked-step-000008").exists()
    assert any(line.startswith("resume: removed 4 leftover(s)") for line in said), said
    # resume is still bitwise exact
    assert first.losses + second.losses == straight.losses
    a, b = load_file(str(straight.checkpoint / "model.safetensors")), load_file(str(second.checkpoint / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_leftovers_of_a_live_process_are_kept(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=4, checkpoint_every=0, eval_every=0)
    Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = ckpts / f".tmp-step-000006-{live.pid}"
        busy.mkdir()
        trainer = Trainer(cfg.replace(steps=6), options=TrainOptions(resume="auto", **QUIET))
        assert busy.is_dir() and trainer.recovery is not None and trainer.recovery.removed == []
        assert trainer.recovery.unhooked == []  # step 4's hook ran: nothing to re-run
    finally:
        live.kill()
        live.wait()
