"""kill -9 in the middle of ``plyx rl grpo``, then ``--resume``: the result is bitwise the uninterrupted run's
(policy, optimizer state, RNG, sampler position, logged metrics)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from ._grpo_fixtures import setup_run, tiny_model

STEPS = 8
TIMING = ("gen_s", "train_s", "sync_s", "gen_share", "train_share", "samples_per_s", "tokens_per_s")


def _write_config(path, model_dir, data, out_dir):
    path.write_text(f"""
model = "{model_dir}"
data = "{data}"
out_dir = "{out_dir}"
steps = {STEPS}
batch_size = 2
num_generations = 4
max_new_tokens = 6
max_length = 64
save_every = 1
log_every = 1
device = "cpu"
loss_type = "dapo"
num_iterations = 2
beta = 0.04
accuracy_reward = ""

[optimizer]
lr = 1e-3

[[rewards]]
name = "regex_format"
args = {{ pattern = '[a-m0-4]', mode = "search" }}
""", encoding="utf-8")


def _cmd(config, *extra):
    return [sys.executable, "-m", "plyx.specs", "rl", "grpo", str(config), "--no-progress", *extra]


@pytest.fixture
def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return e


def test_resume_after_kill_is_bitwise_exact(tmp_path, env):
    from plyx.model import save_checkpoint
    from plyx.rl._demo import build_tokenizer

    _, _, data = setup_run(tmp_path, n_prompts=10)
    model_dir = tmp_path / "model"
    save_checkpoint(tiny_model(), model_dir)
    build_tokenizer(model_dir)  # tokenizer.json and tokenizer_config.json (the chat template) beside the weights
    ref_cfg, cut_cfg = tmp_path / "ref.toml", tmp_path / "cut.toml"
    _write_config(ref_cfg, model_dir, data, tmp_path / "ref")
    _write_config(cut_cfg, model_dir, data, tmp_path / "cut")

    done = subprocess.run(_cmd(ref_cfg), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    proc = subprocess.Popen(_cmd(cut_cfg), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "cut" / "state"
    deadline = time.monotonic() + 240
    while not (state / "step-00000003").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: no handler, no final save
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "cut" / "model").exists(), "the run finished before the kill: the test proves nothing"
    stepped = sorted(p.name for p in state.iterdir() if p.name.startswith("step-"))
    assert stepped and stepped[-1] < f"step-{STEPS:08d}"

    resumed = subprocess.run(_cmd(cut_cfg, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout

    final = f"step-{STEPS:08d}"
    for name in ("policy.safetensors", "optimizer.safetensors", "rng.safetensors"):
        a = load_file(str(tmp_path / "ref" / "state" / final / name))
        b = load_file(str(tmp_path / "cut" / "state" / final / name))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), f"{name}: {k} differs"
    sa = json.loads((tmp_path / "ref" / "state" / final / "trainer_state.json").read_text())
    sb = json.loads((tmp_path / "cut" / "state" / final / "trainer_state.json").read_text())
    assert sa == sb  # sampler position, scheduler, counters
    rows = [[{k: v for k, v in json.loads(line).items() if k not in TIMING}
             for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("ref", "cut")]
    assert [r["step"] for r in rows[1]] == list(range(1, STEPS + 1))
    assert json.dumps(rows[0]) == json.dumps(rows[1])  # NaN-safe exact comparison
