"""Key-padding masks ``[B, 1, 1, S]`` with T > 1: what the serving engine passes for left-padded mixed batches.

Every implementation given the broadcast mask must equal the float64 reference
given the same mask expanded to an explicit ``[B, H, T, S]`` (and, for the
reference itself, the naive per-query loop of the reference tests). Padding is
on the left, of a random length per row (a row may have none); queries at
padded positions see nothing and must give 0.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel.attention import attention_reference, attention_sdpa, attention_triton

from .conftest import INTERPRETING, TRITON_DEVICE, rel_err
from .test_attention_reference import _naive


def _left_padded(B, T, H, KV, D, dtype=torch.float64, device="cpu"):
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = torch.randn(B, T, KV, D, dtype=dtype, device=device)
    v = torch.randn(B, T, KV, D, dtype=dtype, device=device)
    pads = torch.randint(0, T - 1, (B,))
    pads[0] = 0  # one row without padding
    keep = torch.arange(T)[None, :] >= pads[:, None]  # (B, S): True = a real token
    return q, k, v, keep[:, None, None, :].to(device), pads


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_reference_key_padding_mask_equals_explicit_full_mask(seed, causal, additive):
    B, T, H, KV, D = 3, 7, 4, 2, 8
    q, k, v, keep, pads = _left_padded(B, T, H, KV, D)
    mask = keep if not additive else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    full = mask.expand(B, H, T, T).clone()  # the same mask spelled out per head and query
    o, lse = attention_reference(q, k, v, causal=causal, mask=mask, return_lse=True)
    o_full, lse_full = attention_reference(q, k, v, causal=causal, mask=full, return_lse=True)
    o_naive, lse_naive = _naive(q, k, v, causal=causal, mask=full)
    assert torch.equal(o, o_full) and torch.equal(lse, lse_full), seed
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_naive)), seed  # the same empty rows
    finite = torch.isfinite(lse_naive)
    assert rel_err(o, o_naive) < 1e-12 and rel_err(lse[finite], lse_naive[finite]) < 1e-6, seed  # lse is float32
    if causal:  # a padded query sees only padded keys: nothing
        for b, p in enumerate(pads.tolist()):
            assert torch.all(o[b, :p] == 0), seed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_sdpa_key_padding_mask_matches_reference(seed, dtype):
    B, T, H, KV, D = 3, 9, 4, 1, 8
    q, k, v, keep, _ = _left_padded(B, T, H, KV, D, dtype=dtype)
    o = attention_sdpa(q, k, v, causal=True, mask=keep, window=5)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, mask=keep.expand(B, H, T, T), window=5)
    assert o.shape == q.shape and rel_err(o, ref) < (1e-12 if dtype == torch.float64 else 1e-5), seed


@pytest.mark.skipif(not INTERPRETING and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_key_padding_mask_matches_reference_with_gradients(seed):
    B, T, H, KV, D = 2, 20, 2, 1, 16
    q, k, v, keep, _ = _left_padded(B, T, H, KV, D, dtype=torch.float16, device=TRITON_DEVICE)
    for t in (q, k, v):
        t.requires_grad_(True)
    o = attention_triton(q, k, v, causal=True, mask=keep)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = attention_reference(qd, kd, vd, causal=True, mask=keep.expand(B, H, T, T))
    assert rel_err(o, ref) < 3e-3, seed
    do = torch.randn_like(o)
    o.backward(do)
    ref.backward(do.double())
    for name, got, want in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        assert rel_err(got, want) < 5e-3, f"{name} seed={seed}"
