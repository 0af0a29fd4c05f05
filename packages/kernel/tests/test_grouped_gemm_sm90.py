"""The MoE kernels compile for sm_90 on any machine (no GPU): pipelined async copies, wgmma, no spills."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "bench" / "compile_moe_sm90.py"


def _nvidia_backend() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _nvidia_backend(), reason="needs triton's NVIDIA backend (ptxas, cuobjdump)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in: with a GPU the CUDA tests run the kernels")
def test_moe_kernels_compile_for_hopper_without_spills(tmp_path):
    # a fresh interpreter: the kernels must be decorated compiled (this session may have set TRITON_INTERPRET)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    records = json.loads((tmp_path / "compile-moe-sm90.json").read_text())["kernels"]
    fused = next(r for r in records if "SwiGLU" in r["kernel"])
    assert fused["wgmma"] > 0 and fused["cp_async"] > 0 and fused["stack"] == 0
    assert len(records) == 12 and all(r["ok"] for r in records)
