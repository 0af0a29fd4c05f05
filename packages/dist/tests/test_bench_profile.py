"""``bench/fsdp_ws1_vs_plain.py --profile --before`` end to end on CPU, and the kernel classification.

The benchmark's comparison must be right about what it compares: both paths run the same model
(the same matrix multiplications per step), only the FSDP paths run FSDP's hooks, and the FSDP
path of plyx-dist 1.2 (``fsdp-dtensor``) pays DTensor's dispatch in its optimizer step (the fused
AdamW op recorded twice per parameter group: on the DTensors, then on their local tensors), which
the current path does not. Six tiny ``plyx train`` processes on the fixture's shards (~30 s). Device-side
``record_function`` spans are no kernels (a synthetic CUDA profile).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _step_profile():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("_step_profile", BENCH / "_step_profile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "GEMM"),
    ("aten::mm", "GEMM"), ("aten::addmm", "GEMM"),
    ("_attn_fwd", "attention"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("_rmsnorm_fwd", "norm"), ("_ce_kernel", "loss"),
    ("ncclDevKernel_AllGather_RING_LL", "collective"), ("c10d::allreduce_", "collective"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"), ("Memset (Device)", "memcpy/memset"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
    ("aten::_fused_adamw_", "optimizer"), ("aten::_foreach_norm", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise/copy"),
    ("aten::copy_", "elementwise/copy"), ("aten::comm_like_name", "elementwise/copy"),
])
def test_kernel_kinds(name, kind):
    assert _step_profile().classify(name) == kind


def test_profile_compares_plain_fsdp_and_the_dtensor_path(prepared, tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "fsdp_ws1_vs_plain.py"), "--preset", "tiny", "--warmup", "2", "--steps", "3",
         "--paths", "plain,fsdp,fsdp-dtensor", "--data", str(prepared),
         "--profile", "--profile-warmup", "1", "--profile-steps", "2", "--out", str(out),
         "--profile-dir", str(tmp_path / "prof")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == ["plain", "fsdp", "fsdp-dtensor"]
    assert all(r["cpu_ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # the timed window: 3 steps after 2 of warm-up, tokens/s from its wall time
    assert all(r["warmup"] == 2 and r["timed_steps"] == 3 for r in rows)
    assert all(r["tokens_per_s"] == pytest.approx(1e3 * r["batch"] * r["seq_len"] / r["ms_per_step"]) for r in rows)
    assert all(r["kernels_differ"] == "" for r in rows)  # float32 on CPU: the same kernels in every path
    (found,) = (tmp_path / "prof").glob("fsdp_ws1_profile-*.json")
    doc = json.loads(found.read_text())
    assert (tmp_path / "prof" / found.name.replace(".json", ".txt")).is_file()
    assert sorted(doc["comparisons"]) == ["plain:fsdp", "plain:fsdp-dtensor"]
    kinds = doc["comparisons"]["plain:fsdp"]["kinds"]
    assert set(kinds) == {*_step_profile().KINDS, "total"}
    assert kinds["GEMM"]["a_launches"] == kinds["GEMM"]["b_launches"] > 0  # the same model in both paths
    ops = {name: p["ops"] for name, p in doc["profiles"].items()}
    assert any(k.startswith("FSDP::") for k in ops["fsdp"]) and not any(k.startswith("FSDP::") for k in ops["plain"])
    steps = doc["steps"]
    adamw = {name: o["aten::_fused_adamw_"][0] / steps for name, o in ops.items()}
    assert adamw["fsdp"] == adamw["plain"] == 2  # one call per parameter group (decay, no_decay)
    assert adamw["fsdp-dtensor"] == 4  # the DTensor op, then its local op
    assert "PythonSubclass" in ops["fsdp-dtensor"] and "PythonSubclass" not in ops["fsdp"]


def test_device_side_record_function_spans_are_not_kernels():
    """A CUDA profile lists a ``record_function`` range on the device timeline too, spanning kernels already
    counted: ``compare`` must not add it to the kernel time (it did: +15.5 ms of phantom elementwise work on
    the FSDP side of the H100 profile of 2026-11-24). Real kernels stay, whatever their names."""
    sp = _step_profile()
    kernel = "void at::native::vectorized_elementwise_kernel<4, ...>"

    def profile(extra_kernels, ops):
        return {"steps": 1, "cuda": True, "wall_ms_per_step": 1.0, "process_cpu_ms_per_step": 1.0,
                "op_cpu_ms_per_step": 1.0, "kernels": {"nvjet_gemm": [2, 4000.0], kernel: [3, 1000.0],
                                                       **extra_kernels}, "ops": ops}

    plain = profile({"Optimizer.step#AdamW.step": [1, 900.0]}, {"Optimizer.step#AdamW.step": [1, 50.0]})
    fsdp = profile({"FSDP::pre_forward (layers.0)": [1, 4500.0], "Optimizer.step#AdamW.step": [1, 900.0],
                    "Memcpy DtoD (Device -> Device)": [5, 300.0]},
                   {"FSDP::pre_forward (layers.0)": [1, 80.0], "Optimizer.step#AdamW.step": [1, 50.0]})
    cmp = sp.compare(plain, fsdp)
    assert cmp["kinds"]["total"]["a_ms"] == pytest.approx(5.0)
    assert cmp["kinds"]["total"]["b_ms"] == pytest.approx(5.3)  # + the memcpy only
    assert cmp["kinds"]["elementwise/copy"]["b_ms"] == cmp["kinds"]["elementwise/copy"]["a_ms"] == pytest.approx(1.0)
    assert {r["name"] for r in cmp["top_kernels"]} == {"nvjet_gemm", kernel, "Memcpy DtoD (Device -> Device)"}
    # on CPU the kernels are ops (aten::mm in both tables): nothing is dropped there
    cpu = {**plain, "cuda": False, "kernels": {"aten::mm": [1, 10.0]}, "ops": {"aten::mm": [1, 10.0]}}
    assert sp.device_kernels(cpu) == {"aten::mm": [1, 10.0]}


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (NCCL, bf16 autocast)")
def test_fsdp_autocast_runs_the_plain_paths_kernels_on_cuda(prepared, tmp_path):
    """On CUDA: ``fsdp-autocast`` (float32 parameters under autocast) serves every kernel in the plain path's
    implementation and dtype; ``fsdp`` (bf16 ``param_dtype``) runs RMSNorm in bf16, which the row names."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "fsdp_ws1_vs_plain.py"), "--preset", "tiny", "--warmup", "2", "--steps", "3",
         "--paths", "plain,fsdp,fsdp-autocast", "--data", str(prepared), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(r["precision"] == "bf16-autocast" and r["tokens_per_s"] > 0 for r in rows.values())
    assert "rmsnorm[float32]" in rows["plain"]["kernels"]
    assert rows["fsdp-autocast"]["kernels"] == rows["plain"]["kernels"] and rows["fsdp-autocast"]["kernels_differ"] == ""
    assert "rmsnorm[bfloat16]" in rows["fsdp"]["kernels"] and "rmsnorm" in rows["fsdp"]["kernels_differ"]
