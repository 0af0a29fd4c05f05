"""``bench/profile_step.py`` end to end at its smallest settings: both steps profiled, ops counted, files written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture()
def profile_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import profile_step as module

    yield module
    sys.modules.pop("profile_step", None)
    sys.modules.pop("step_vs_nanogpt", None)


def test_profile_step_writes_the_breakdown(profile_step, tmp_path):
    assert profile_step.main(["--steps", "1", "--iters", "3", "--allocator", "glibc", "--out", str(tmp_path)]) == 0
    (json_file,) = tmp_path.glob("profile-step-cpu-*.json")
    row = json.loads(json_file.read_text())
    assert json_file.with_suffix(".txt").read_text().startswith("cpu (")
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file and renamed
    for side in ("plyx", "nanogpt"):
        ops = row["ops"][side]
        assert ops["categories"]["gemm"] > 0 and ops["total_ms"] >= ops["categories"]["gemm"]
        counts = row["op_counts"][side]
        # every step multiplies matrices forward and backward; the optimizer is one fused AdamW either way
        assert counts["forward_ops"]["aten.mm"] > 0 and counts["backward_ops"]["aten.mm"] > 0
        assert counts["optimizer"] == row["op_counts"]["nanogpt"]["optimizer"]
        assert row["fixed_cost"][side]["forward_ms"] > 0
    # nanoGPT's GPT-2 block uses LayerNorm, plyx's Llama block does not
    assert "aten.native_layer_norm" in row["op_counts"]["nanogpt"]["forward_ops"]
    assert "aten.native_layer_norm" not in row["op_counts"]["plyx"]["forward_ops"]


def test_categories(profile_step):
    assert profile_step._category("aten::mm") == "gemm"
    assert profile_step._category("aten::native_layer_norm_backward") == "norm"
    assert profile_step._category("aten::silu_backward") == "mlp activation"
    assert profile_step._category("aten::view") == "rest (views, dispatch, autograd)"
