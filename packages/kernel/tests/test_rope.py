"""Triton RoPE against the float64 reference, and ``rope_tables`` (Llama-3 and linear scaling)."""

from __future__ import annotations

import math

import pytest
import torch
from plyx.kernel import KernelInputError, inv_frequencies, rope_tables
from plyx.kernel.reference import rope as reference
from plyx.kernel.triton_ops.rope import rope
from plyx.specs import RopeScaling

from .conftest import GPU, TRITON_DEVICE

# (B, T, H, Dh, R): full and partial rotary, odd head counts, H=17 straddles the 16-head block
SHAPES = [(1, 1, 1, 2, 2), (2, 5, 3, 16, 16), (2, 7, 17, 10, 6), (1, 3, 4, 20, 12)]
if GPU:
    SHAPES += [(2, 1024, 32, 128, 128), (1, 333, 8, 80, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("batched", [False, True], ids=["tables[T]", "tables[B,T]"])
def test_matches_reference(parity, make, shape, dtype, interleaved, batched):
    b, t, h, dh, r = shape
    positions = torch.randint(0, 4096, (b, t) if batched else (t,))
    cos, sin = rope_tables(positions.to(TRITON_DEVICE), r, 10000.0, dtype=dtype)
    x = make(b, t, h, dh, dtype=dtype)
    parity(lambda x, c, s: rope(x, c, s, interleaved=interleaved), lambda x, c, s: reference(x, c, s, interleaved=interleaved),
           [x, cos, sin], grad=(0,), dtype=dtype, label=f"rope {shape} interleaved={interleaved}")


def test_strided_heads_of_a_fused_qkv_view(parity, make):
    qkv = make(2, 6, 3 * 4 * 8)  # (B, T, 3 * H * Dh)
    q = qkv.view(2, 6, 3, 4, 8)[:, :, 0]  # (B, T, H, Dh), token stride 96
    cos, sin = rope_tables(torch.arange(6, device=TRITON_DEVICE), 8, 10000.0)
    parity(rope, reference, [q, cos, sin], grad=(0,), label="qkv view")


def test_tables_match_the_closed_form():
    cos, sin = rope_tables(torch.tensor([0, 1, 7]), 8, 10000.0, dtype=torch.float64)
    inv = [10000.0 ** (-2 * i / 8) for i in range(4)]
    want = torch.tensor([[math.cos(p * f) for f in inv] for p in (0, 1, 7)], dtype=torch.float64)
    assert torch.allclose(cos, want, atol=1e-6) and torch.allclose(sin**2 + cos**2, torch.ones_like(cos), atol=1e-6)


def test_linear_scaling_divides_positions():
    scaled = rope_tables(torch.arange(0, 40, 4), 16, 500000.0, RopeScaling(kind="linear", factor=4.0))
    plain = rope_tables(torch.arange(10), 16, 500000.0)
    assert torch.allclose(scaled[0], plain[0], atol=1e-5) and torch.allclose(scaled[1], plain[1], atol=1e-5)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    scaling = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    plain, scaled = inv_frequencies(128, 500000.0), inv_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8.0)
    mid = ~high & ~low  # smoothly between the two
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_llama3_scaling_matches_transformers():
    """Bit-equal to transformers' Llama 3.1 frequencies (skipped where transformers is absent)."""
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    common = {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072}
    try:
        config = LlamaConfig(**common, rope_parameters=params)
        want, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    except (TypeError, KeyError):  # transformers before 5 spells it rope_theta + rope_scaling
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        config = LlamaConfig(**common, rope_theta=params["rope_theta"], rope_scaling=scaling)
        want, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = inv_frequencies(128, 500000.0, RopeScaling(kind="llama3", factor=8.0))
    assert torch.equal(got, want.float())


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(2, 5, 3, 8, device=TRITON_DEVICE)
    cos, sin = rope_tables(torch.arange(5, device=TRITON_DEVICE), 8, 10000.0)
    with pytest.raises(KernelInputError, match=r"rope:triton.*`x`.*\[B, T, H, Dh\]"):
        rope(x[0], cos, sin)
    with pytest.raises(KernelInputError, match=r"`cos`.*T=5"):
        rope(x, cos[:4], sin[:4])
    big = rope_tables(torch.arange(5, device=TRITON_DEVICE), 10, 10000.0)
    with pytest.raises(KernelInputError, match=r"`cos`.*R=10.*Dh=8"):
        rope(x, *big)
    with pytest.raises(KernelInputError, match=r"rotary_dim.*even"):
        rope_tables(torch.arange(5), 7, 10000.0)
    with pytest.raises(KernelInputError, match=r"positions.*integer"):
        rope_tables(torch.arange(5.0), 8, 10000.0)
