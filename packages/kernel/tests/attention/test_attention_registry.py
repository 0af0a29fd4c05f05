"""Selection of ``attention`` / ``paged_attention`` through the registry of plyx-kernel."""

from __future__ import annotations

import plyx.kernel
import pytest
import torch
from plyx.kernel import Registry
from plyx.kernel.attention import register
from plyx.specs import KernelQuery

from .conftest import rel_err


@pytest.fixture
def reg() -> Registry:
    r = Registry()
    register(r)
    return r


def _q(device="cuda", dtype="bfloat16", cc=(9, 0), head_dim=128, grad=False):
    return KernelQuery(device_type=device, dtype=dtype, compute_capability=cc, shape={"head_dim": head_dim},
                       requires_grad=grad)


def test_every_implementation_is_registered(reg):
    assert {i.impl for i in reg.implementations("attention")} == {"reference", "sdpa", "triton", "hybrid"}
    assert {i.impl for i in reg.implementations("paged_attention")} == {"reference", "triton"}


@pytest.mark.parametrize(
    "query,attention,paged",
    [
        (_q(), "triton", "triton"),
        (_q(dtype="float16", head_dim=64, grad=True), "triton", "reference"),  # paged has no backward
        (_q(head_dim=96), "sdpa", "reference"),  # head_dim outside {64, 128}
        (_q(dtype="float32"), "sdpa", "reference"),
        (_q(cc=(7, 5)), "sdpa", "reference"),  # Turing: no bf16 tensor cores
        (_q(device="cpu", cc=None), "sdpa", "reference"),
    ],
)
def test_selection_by_capability(reg, query, attention, paged):
    assert reg.select("attention", query).impl == attention
    assert reg.select("paged_attention", query).impl == paged


def test_explain_says_why_triton_is_refused(reg):
    lines = {c.impl.impl: c for c in reg.explain("attention", _q(head_dim=96))}
    assert not lines["triton"].taken and "head_dim=96" in lines["triton"].reason
    assert lines["sdpa"].taken


def test_hybrid_is_chosen_by_name_only(reg):
    """``hybrid`` (SDPA for plain causal calls, Triton for the rest) never wins by priority; an override takes it
    where the Triton kernel runs, and falls back to the priorities where it does not."""
    assert reg.select("attention", _q(grad=True)).impl == "triton"
    with reg.override(attention="hybrid"):
        assert reg.select("attention", _q(grad=True)).impl == "hybrid"
        with pytest.warns(Warning, match="hybrid"):
            assert reg.select("attention", _q(device="cpu", cc=None)).impl == "sdpa"


def test_override_forces_the_reference(reg):
    with reg.override(attention="reference"):
        assert reg.select("attention", _q()).impl == "reference"


def test_default_registry_serves_attention_on_this_machine(seed):
    # the plugin's plyx_register_attention_backends hook calls register()
    reg = plyx.kernel.registry()
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    fn = reg.get("attention", q, k, v)
    ref = plyx.kernel.attention.attention_reference(q.double(), k.double(), v.double())
    assert rel_err(fn(q, k, v), ref) < 1e-5, seed
    pools = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    tables = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
    lens = torch.tensor([13], dtype=torch.int32)
    paged = reg.get("paged_attention", q[:1, :1], *pools)
    out = paged(q[:1, :1], *pools, tables, lens)
    assert out.shape == (1, 1, 4, 8) and torch.isfinite(out).all()
