"""The flash kernel's TMA and atomic-dQ variants compile for sm_90 on any machine (no GPU): wgmma, TMA bulk
copies, no spills."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "bench" / "attention" / "compile_flash_sm90.py"


def _nvidia_backend() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _nvidia_backend(), reason="needs triton's NVIDIA backend (ptxas, cuobjdump)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in: with a GPU the sweep runs the kernels")
def test_flash_tma_variants_compile_for_hopper_without_spills(tmp_path):
    # a fresh interpreter: the kernels must be decorated compiled (this session may have set TRITON_INTERPRET)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, str(SCRIPT), "--variants", "tma", "tma-atomic-dq", "--causal", "true",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    records = json.loads((tmp_path / "compile-flash-sm90.json").read_text())["kernels"]
    # forward, dK/dV and dQ of "tma"; the dK/dV with atomic dQ of "tma-atomic-dq" (no dQ kernel)
    assert sorted(r["which"] for r in records) == ["dkdv", "dkdv", "dq", "fwd"]
    for r in records:
        assert r["ok"] and r["TMA"] and r["tma"] > 0 and r["wgmma"] > 0 and r["stack"] == 0, r
    assert any(r.get("ATOMIC_DQ") for r in records)
