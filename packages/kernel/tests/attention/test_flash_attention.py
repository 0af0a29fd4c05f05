"""The Triton flash attention against the float64 reference, at small shapes.

Runs in Triton's interpreter on CPU (``TRITON_INTERPRET=1``, set by conftest
when there is no CUDA) and compiled on a GPU otherwise. Every case compares
the output, the log-sum-exp and the gradients of q, k and v with the float64
reference on fresh random inputs, with lengths that are not multiples of the
block sizes (16 in the interpreter, 32..128 on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel.attention import attention_reference, attention_triton

from .conftest import INTERPRETING, TRITON_DEVICE, grad_err, rel_err

pytestmark = pytest.mark.skipif(
    not INTERPRETING and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)

#: ||o - o_ref|| / ||o_ref|| bounds per dtype: fp16 keeps 10 mantissa bits (P and O are rounded
#: to it once each), bf16 keeps 7, so about 8x looser
TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
#: gradients go through two more rounded products (dP, dS)
GRAD_TOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _check(seed, B, T, S, H, KV, D, dtype=torch.float16, grad=True, **kw):
    dev = TRITON_DEVICE
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, S, KV, D, device=dev, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, S, KV, D, device=dev, dtype=dtype, requires_grad=grad)
    o, lse = attention_triton(q, k, v, return_lse=True, **kw)
    q64, k64, v64 = (x.detach().double().requires_grad_(grad) for x in (q, k, v))
    o_ref, lse_ref = attention_reference(q64, k64, v64, return_lse=True, **kw)
    where = f"seed={seed} shape={(B, T, S, H, KV, D)} {dtype} {kw}"
    assert o.shape == q.shape and o.dtype == dtype
    assert rel_err(o, o_ref) < TOL[dtype], where
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), where  # empty rows: -inf
    assert torch.allclose(lse[finite].double(), lse_ref[finite].double(), rtol=1e-3, atol=1e-3), where
    if grad:
        do = torch.randn_like(o)
        o.backward(do)
        o_ref.backward(do.double())
        for name, got, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
            assert torch.isfinite(got).all(), f"{name} not finite: {where}"
            assert grad_err(got, ref) < GRAD_TOL[dtype], f"{name}: {where}"
    return o


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("H,KV", [(2, 2), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_matches_reference(seed, causal, H, KV, dtype):
    _check(seed, 2, 37, 37, H, KV, 64, dtype, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_head_dim_128(seed, causal):
    _check(seed, 1, 33, 33, 4, 2, 128, torch.bfloat16, causal=causal)


@pytest.mark.parametrize("T,S", [(1, 45), (20, 45), (16, 64)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_queries_are_the_last_positions(seed, T, S, causal):
    # T < S: bottom-right alignment, as when prefilling after a cache
    _check(seed, 2, T, S, 4, 2, 64, causal=causal)


@pytest.mark.parametrize("window,causal", [(1, True), (7, True), (100, True), (5, False)])
def test_flash_sliding_window(seed, window, causal):
    _check(seed, 1, 40, 40, 2, 1, 64, causal=causal, window=window)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_documents(seed, causal):
    T = 41
    docs = torch.sort(torch.randint(0, 6, (2, T)), dim=1).values
    docs[0, :3] = torch.tensor([-5, -4, -3])  # three documents of length 1
    docs[1, -1] = 99  # and one at the end
    _check(seed, 2, T, T, 4, 2, 64, causal=causal, document_ids=docs.to(TRITON_DEVICE))


def test_flash_interleaved_document_ids(seed):
    # ids need not be contiguous runs: tokens attend to every earlier token with the same id
    docs = torch.randint(0, 3, (2, 33))
    _check(seed, 2, 33, 33, 2, 1, 64, causal=True, document_ids=docs.to(TRITON_DEVICE))


def test_flash_documents_with_window(seed):
    docs = torch.sort(torch.randint(0, 3, (1, 35)), dim=1).values
    _check(seed, 1, 35, 35, 2, 2, 64, causal=True, window=6, document_ids=docs.to(TRITON_DEVICE))


def test_flash_bool_mask_with_empty_rows(seed):
    T, S = 19, 27
    mask = torch.rand(2, 2, T, S, device=TRITON_DEVICE) > 0.5
    mask[0, 1, 5] = False  # nothing to attend to: output 0, lse -inf, no NaN in gradients
    mask[1, :, 0] = False
    o = _check(seed, 2, T, S, 2, 1, 64, causal=False, mask=mask)
    assert torch.all(o[0, 5, 1] == 0) and torch.all(o[1, 0] == 0)


def test_flash_additive_broadcast_mask(seed):
    T = 30
    bias = torch.randn(1, 4, T, T, device=TRITON_DEVICE)
    bias[0, 2, :, 3:9] = float("-inf")
    _check(seed, 2, T, T, 4, 2, 64, causal=True, mask=bias)


def test_flash_single_token(seed):
    _check(seed, 3, 1, 1, 2, 1, 64, causal=True)
    _check(seed, 1, 1, 1, 2, 2, 64, causal=False)


def test_flash_custom_scale_and_strided_inputs(seed):
    # q, k, v as views of one packed qkv projection (non-contiguous time stride)
    B, T, H, D = 2, 23, 2, 64
    qkv = torch.randn(B, T, 3, H, D, device=TRITON_DEVICE, dtype=torch.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o = attention_triton(q, k, v, causal=True, scale=0.05)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, scale=0.05)
    assert rel_err(o, ref) < TOL[torch.float16], seed


def test_flash_writes_every_output_element(seed, poison):
    poison()  # outputs and workspaces start as NaN
    _check(seed, 2, 29, 29, 4, 2, 64, causal=True)
    _check(seed, 1, 7, 50, 2, 2, 64, causal=False)


def test_flash_rejects_unsupported_head_dim():
    x = torch.randn(1, 4, 2, 48, device=TRITON_DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim=48"):
        attention_triton(x, x, x)
