"""bench/profile_moe.py: the kernel grouping, and a tiny CPU run writing its table and record."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "profile_moe.py"


def _module():
    spec = importlib.util.spec_from_file_location("profile_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "group"), [
    ("_grouped_kernel", "gemm"), ("_weight_grad_kernel", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"), ("aten::mm", "gemm"),
    ("_gather_kernel", "permutation"), ("_scatter_kernel", "permutation"), ("_source_rows_kernel", "permutation"),
    ("_routing_kernel", "permutation"),
    ("void cub::DeviceRadixSortOnesweepKernel<...>", "permutation"),
    ("void at::native::index_elementwise_kernel<128, 4>", "permutation"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "routing"),
    ("void (anonymous namespace)::cunn_SoftMaxForward<4, float>", "routing"), ("_tile_kernel", "routing"),
    ("_swiglu_grad_kernel", "elementwise"), ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
    ("something_new", "other"),
])
def test_kernels_fall_into_their_groups(name, group):
    assert _module().classify(name) == group


def test_tiny_cpu_profile_writes_table_and_record(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (record,) = tmp_path.glob("profile-moe-*.json")
    doc = json.loads(record.read_text())
    assert doc["groups_ms"]["gemm"] > 0 and doc["steps"] == 2
    assert {r["group"] for r in doc["rows"]} <= {"gemm", "permutation", "routing", "elementwise", "other"}
    assert abs(sum(r["share"] for r in doc["rows"]) - 1) < 1e-6
    table = record.with_suffix(".txt").read_text()
    assert "GEMM" in table and "vs the rest" in table and "aten::mm" in table
