"""A CPU training step's stacked q/k/v projection (``stacked_for_training``) against the linears one by one.

One GEMM over the concatenated weights, q and k rotated together (interleaved pairs, the weight rows
reordered per head) must give the attention output and every gradient of the plain path, in float64.
"""

from __future__ import annotations

import plyx.attn._attention as attention_module
import pytest
import torch
from plyx.attn import Attention, stacked_for_training
from plyx.kernel import rope_tables
from torch import nn

F64 = torch.float64


def _attention(heads: int, kv: int, bias: bool, qk_norm: bool) -> Attention:
    torch.manual_seed(0)
    att = Attention(d_model=24, n_heads=heads, n_kv_heads=kv, head_dim=8, qkv_bias=bias, qk_norm=qk_norm, dtype=F64)
    for name, p in att.named_parameters():
        if name.endswith("bias") or "norm" in name:
            nn.init.normal_(p)  # nonzero biases and norm weights: their rows' order is exercised
    return att


def _output_and_grads(att: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    out = att(x, cos, sin)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad(out, [x, *att.parameters()], cot)


@pytest.mark.parametrize(("heads", "kv", "bias", "qk_norm", "rotary"),
                         [(3, 3, False, False, 8), (4, 2, True, False, 8), (4, 1, False, False, 8),
                          (2, 2, True, True, 8), (2, 1, False, False, 4)])
def test_stacked_training_projection_is_the_linears_one_by_one(monkeypatch, heads, kv, bias, qk_norm, rotary):
    att = _attention(heads, kv, bias, qk_norm)
    x = torch.randn(2, 5, 24, dtype=F64, requires_grad=True)
    cos, sin = rope_tables(torch.arange(5), rotary, 100.0, dtype=F64)  # rotary 4 < head_dim 8: partial rotary
    calls = []
    real = attention_module.stacked_for_training
    monkeypatch.setattr(attention_module, "stacked_for_training",
                        lambda *a, **k: calls.append(k.get("arrange")) or real(*a, **k))
    fast, fast_grads = _output_and_grads(att, x, cos, sin)
    assert len(calls) == 1 and (calls[0] is not None) == (not qk_norm and rotary == 8)  # pairs: RoPE spans each head
    monkeypatch.setattr(attention_module, "stacked_for_training", lambda *a, **k: None)
    plain, plain_grads = _output_and_grads(att, x, cos, sin)
    torch.testing.assert_close(fast, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(fast_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_stacked_for_training_only_where_the_weights_are_the_output():
    torch.manual_seed(0)
    lins = [nn.Linear(8, n, bias=False) for n in (6, 2, 2)]
    x = torch.randn(3, 8)
    weight, bias = stacked_for_training(lins, x)
    assert bias is None and weight.requires_grad
    torch.testing.assert_close(weight, torch.cat([lin.weight for lin in lins]), rtol=0, atol=0)
    with torch.no_grad():
        assert stacked_for_training(lins, x) is None  # no gradient recorded: the linears one by one
    assert stacked_for_training(lins, x.to("meta")) is None  # another device
    handle = lins[1].register_forward_hook(lambda *_: None)
    assert stacked_for_training(lins, x) is None  # a hook would be skipped
    handle.remove()

    class Wrapped(nn.Linear):
        pass

    assert stacked_for_training([*lins[:2], Wrapped(8, 2)], x) is None  # not a plain linear (e.g. an adapter)
    mixed = [nn.Linear(8, 6), nn.Linear(8, 2, bias=False)]
    assert stacked_for_training(mixed, x) is None  # some with a bias, some without
    for lin in lins:
        lin.weight.requires_grad_(False)
    assert stacked_for_training(lins, x) is None  # frozen weights (e.g. adapter training): nothing to gain
