"""Triton RoPE of q and k in one launch against the float64 reference (GQA/MQA head counts, both layouts,
partial rotary, per-batch tables), its gradients (one output unused too), and the reference itself."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError, rope_tables
from plyx.kernel.reference import rope as reference_rope
from plyx.kernel.reference import rope_qk as reference
from plyx.kernel.triton_ops.rope_qk import rope_qk

from .conftest import GPU, TRITON_DEVICE

# (B, T, H, KV, Dh, R): MHA, GQA, MQA; partial rotary; H=17 straddles the 16-head block; KV > 16 too
SHAPES = [(1, 1, 1, 1, 2, 2), (2, 5, 4, 2, 16, 16), (2, 7, 17, 1, 10, 6), (1, 3, 6, 18, 20, 12)]
if GPU:
    SHAPES += [(2, 1024, 32, 8, 128, 128), (1, 333, 12, 4, 80, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("batched", [False, True], ids=["tables[T]", "tables[B,T]"])
def test_matches_reference(parity, make, shape, dtype, interleaved, batched):
    b, t, h, kv, dh, r = shape
    positions = torch.randint(0, 4096, (b, t) if batched else (t,))
    cos, sin = rope_tables(positions.to(TRITON_DEVICE), r, 10000.0, dtype=dtype)
    q, k = make(b, t, h, dh, dtype=dtype), make(b, t, kv, dh, dtype=dtype)
    parity(lambda q, k, c, s: rope_qk(q, k, c, s, interleaved=interleaved),
           lambda q, k, c, s: reference(q, k, c, s, interleaved=interleaved),
           [q, k, cos, sin], grad=(0, 1), dtype=dtype, label=f"rope_qk {shape} interleaved={interleaved}")


def test_strided_q_and_k_of_a_fused_qkv_view(parity, make):
    qkv = make(2, 6, (4 + 2 + 2) * 8)  # (B, T, (H + 2 KV) * Dh)
    heads = qkv.view(2, 6, 8, 8)
    q, k = heads[:, :, :4], heads[:, :, 4:6]  # token stride 64: views, not copies
    cos, sin = rope_tables(torch.arange(6, device=TRITON_DEVICE), 8, 10000.0)
    parity(rope_qk, reference, [q, k, cos, sin], grad=(0, 1), label="qkv view")


@pytest.mark.parametrize("used", ["q", "k"])
def test_gradient_when_one_output_is_unused(make, used):
    q = make(2, 4, 4, 8).requires_grad_()
    k = make(2, 4, 2, 8).requires_grad_()
    cos, sin = rope_tables(torch.arange(4, device=TRITON_DEVICE), 8, 10000.0)
    qo, ko = rope_qk(q, k, cos, sin)
    out = qo if used == "q" else ko
    gq, gk = torch.autograd.grad((out * out).sum(), (q, k), allow_unused=True)
    src = q if used == "q" else k
    want = torch.autograd.grad((reference_rope(src, cos, sin) ** 2).sum(), src)[0]
    got, other = (gq, gk) if used == "q" else (gk, gq)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert other is None or torch.count_nonzero(other) == 0


def test_reference_is_rope_twice_and_passes_gradcheck():
    q = torch.randn(1, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(torch.arange(3), 4, 10000.0, dtype=torch.float64)
    qo, ko = reference(q, k, cos, sin, interleaved=True)
    assert torch.equal(qo, reference_rope(q, cos, sin, interleaved=True))
    assert torch.equal(ko, reference_rope(k, cos, sin, interleaved=True))
    assert torch.autograd.gradcheck(lambda a, b: reference(a, b, cos, sin), (q, k))


def test_bad_inputs_name_kernel_and_argument():
    cos, sin = rope_tables(torch.arange(4, device=TRITON_DEVICE), 8, 10000.0)
    q = torch.randn(2, 4, 4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"rope_qk:triton.*`k`.*\[B, T, KV, Dh\]"):
        rope_qk(q, torch.randn(2, 5, 2, 8, device=TRITON_DEVICE), cos, sin)
    with pytest.raises(KernelInputError, match=r"`k`.*dtype"):
        rope_qk(q, torch.randn(2, 4, 2, 8, device=TRITON_DEVICE, dtype=torch.float64), cos.double(), sin.double())
    with pytest.raises(KernelInputError, match=r"`cos`"):
        reference(q, q, cos[:3], sin[:3])
