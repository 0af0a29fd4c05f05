"""``plyx.kernel.attention(...)`` and ``plyx.kernel.paged_attention(...)``: dispatch through the default registry."""

from __future__ import annotations

import importlib

import plyx.kernel as K
import torch
from plyx.kernel.attention import attention_reference, paged_attention_reference

from .conftest import rel_err


def test_attention_package_is_callable_and_dispatches(seed):
    q = torch.randn(2, 6, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 2, 8, dtype=torch.float64).unbind(0)
    importlib.import_module("plyx.kernel.attention._flash")  # importing submodules must not rebind the name
    assert K.attention is importlib.import_module("plyx.kernel.attention") and callable(K.attention)
    ref = attention_reference(q, k, v, causal=True, window=4)
    assert rel_err(K.attention(q, k, v, causal=True, window=4), ref) < 1e-12, seed
    with K.registry().override(attention="reference"):
        assert K.registry().get("attention", q, k, v) is attention_reference
        o, lse = K.attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 6) and rel_err(o, attention_reference(q, k, v)) < 1e-12


def test_paged_attention_dispatches(seed):
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    k_pool, v_pool = torch.randn(2, 6, 4, 2, 8, dtype=torch.float64).unbind(0)
    tables = torch.randperm(6)[:6].view(2, 3).to(torch.int32)
    lens = torch.tensor([9, 2], dtype=torch.int32)
    got = K.paged_attention(q, k_pool, v_pool, tables, lens, window=3)
    assert torch.equal(got, paged_attention_reference(q, k_pool, v_pool, tables, lens, window=3)), seed
