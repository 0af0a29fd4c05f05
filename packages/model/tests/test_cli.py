"""`plyx model inspect PATH`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from plyx.model import save_checkpoint, save_hf
from plyx.model._cli import command


def run(*argv: str) -> int:
    cmd = command()
    parser = argparse.ArgumentParser(prog="plyx model")
    cmd.configure(parser)
    return cmd.run(parser.parse_args(list(argv)))


def test_inspect_prints_card_params_dtype_layout(tmp_path, tiny, random_model, capsys) -> None:
    model = random_model(tiny())
    path = save_checkpoint(model, tmp_path / "c", card_fields={"name": "tiny", "license": "Apache-2.0"})
    assert run("inspect", str(path), "--verify") == 0
    out = capsys.readouterr().out
    assert "name         tiny" in out and "layout plyx" in out and "version 2" in out
    assert f"parameters   {model.num_params():,}" in out
    assert "dtype        float32" in out and "verified" in out and "Apache-2.0" in out
    assert run("inspect", str(path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["num_params"] == model.num_params()
    hf = save_hf(model, tmp_path / "h")
    assert run("inspect", str(hf)) == 0
    assert "layout hf" in capsys.readouterr().out


def test_inspect_reports_tampering(tmp_path, tiny, random_model, capsys) -> None:
    path = save_checkpoint(random_model(tiny()), tmp_path / "c")
    shard = next(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    assert run("inspect", str(path), "--verify") == 1
    assert "is truncated" in capsys.readouterr().out


def test_plyx_command_has_model_subcommand(tmp_path, tiny, random_model) -> None:
    path = save_checkpoint(random_model(tiny()), tmp_path / "c")
    env = {**os.environ, "PLYX_PLUGINS": "model,attn,kernel"}
    done = subprocess.run([sys.executable, "-m", "plyx.specs", "model", "inspect", str(path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "parameters" in done.stdout


def test_inspect_shows_the_experts(tmp_path, tiny, random_model, capsys) -> None:
    from plyx.specs.config import MoEConfig

    model = random_model(tiny(arch="qwen2", qkv_bias=True, moe=MoEConfig(num_experts=4, top_k=2, d_expert=16,
                                                                          norm_topk_prob=False, shared_expert_d_ff=8)))
    assert run("inspect", str(save_hf(model, tmp_path / "h"))) == 0
    assert "experts      4 of width 16, top-2 (raw softmax weights), shared expert of width 8" in capsys.readouterr().out
