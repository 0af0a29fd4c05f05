"""The Triton attention kernels compiled on a GPU at real shapes (skipped without CUDA).

Same checks as the interpreter tests (float64 reference on fresh random
inputs, gradients, poisoned outputs) at lengths of thousands of tokens, with
the default launch configs and, where marked, the autotuned ones.
"""

from __future__ import annotations

import os

import pytest
import torch
from plyx.kernel.attention import (
    attention_reference,
    attention_triton,
    paged_attention_reference,
    paged_attention_triton,
)

from .conftest import INTERPRETING, grad_err, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA (compiled Triton)"),
]

TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
GRAD_TOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _attn_case(seed, B, T, S, H, KV, D, dtype, **kw):
    dev = "cuda"
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, KV, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, KV, D, device=dev, dtype=dtype, requires_grad=True)
    o, lse = attention_triton(q, k, v, return_lse=True, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = attention_reference(q64, k64, v64, return_lse=True, **kw)
    o_ref.backward(do.double())
    where = f"seed={seed} {(B, T, S, H, KV, D)} {dtype} {kw}"
    assert rel_err(o, o_ref) < TOL[dtype], where
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin].double(), lse_ref[fin].double(), rtol=1e-3, atol=1e-3), where
    for name, got, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert grad_err(got, ref) < GRAD_TOL[dtype], f"{name}: {where}"


@pytest.fixture(autouse=True)
def _default_configs(monkeypatch):
    # compile one config per case, not the autotuner's dozen (the benchmark tunes)
    monkeypatch.setenv("PLYX_ATTENTION_AUTOTUNE", "0")


@pytest.mark.parametrize(
    "causal,D,dtype",
    [(True, 128, torch.bfloat16), (False, 128, torch.bfloat16), (True, 64, torch.float16), (False, 64, torch.bfloat16),
     (True, 128, torch.float16)],
)
def test_gpu_flash_real_shapes(seed, causal, D, dtype):
    _attn_case(seed, 2, 1000, 1000, 8, 2, D, dtype, causal=causal)


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True, window=129),
        dict(causal=True, document_ids="docs"),
        dict(causal=False, mask="bool"),
        dict(causal=True),  # T < S below
    ],
    ids=["window", "documents", "bool_mask", "decode_align"],
)
def test_gpu_flash_features(seed, kw):
    T = S = 777
    kw = dict(kw)
    if kw.get("document_ids") == "docs":
        kw["document_ids"] = torch.sort(torch.randint(0, 9, (2, T), device="cuda"), dim=1).values
    if kw.get("mask") == "bool":
        mask = torch.rand(2, 1, T, S, device="cuda") > 0.3
        mask[0, 0, 10] = False
        kw["mask"] = mask
    if "window" not in kw and "document_ids" not in kw and "mask" not in kw:
        T = 300
    _attn_case(seed, 2, T, S, 8, 4, 128, torch.bfloat16, **kw)


@pytest.mark.skipif(os.environ.get("PLYX_GPU_AUTOTUNE_TEST", "1") == "0", reason="autotune test disabled")
def test_gpu_flash_autotuned_configs(seed, monkeypatch):
    # every config the autotuner may pick must be correct: force each one through the tuner's winner
    monkeypatch.setenv("PLYX_ATTENTION_AUTOTUNE", "1")
    _attn_case(seed, 1, 2048, 2048, 4, 4, 128, torch.bfloat16, causal=True)


def test_gpu_flash_poisoned_outputs(seed, poison):
    poison()
    _attn_case(seed, 1, 513, 513, 4, 2, 128, torch.bfloat16, causal=True)


@pytest.mark.parametrize("B,ctx,splits", [(1, 32000, None), (8, 4097, None), (64, 1000, None), (3, 20000, 1)])
@pytest.mark.parametrize("Tq", [1, 4])
def test_gpu_paged_real_shapes(seed, B, ctx, splits, Tq, poison):
    poison()
    H, KV, D, bs = 16, 4, 128, 16
    lens = torch.randint(max(ctx // 2, Tq), ctx + 1, (B,), dtype=torch.int32)
    lens[0] = ctx
    max_blocks = -(-ctx // bs)
    num_blocks = B * max_blocks + 7
    k_pool = torch.randn(num_blocks, bs, KV, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(num_blocks, device="cuda")[: B * max_blocks].view(B, max_blocks).int()
    q = torch.randn(B, Tq, H, D, device="cuda", dtype=torch.bfloat16)
    lens = lens.cuda()
    o = paged_attention_triton(q, k_pool, v_pool, tables, lens, num_splits=splits)
    ref = paged_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, lens)
    assert rel_err(o, ref) < TOL[torch.bfloat16], f"seed={seed} B={B} ctx={ctx}"
