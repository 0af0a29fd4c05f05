"""The training step's kernel choice (``training_kernels``): the ``hybrid`` attention's routing, the rule of
``auto``, the errors, and the compile path (SDPA and RMSNorm traced as plain torch ops for Inductor) with the
same values and gradients as the references (float64: equal up to accumulation order)."""

from __future__ import annotations

import importlib

import pytest
import torch
from plyx.kernel import _custom_ops, registry, resolve_training_kernels, training_kernels
from plyx.kernel.attention import _hybrid as hybrid_mod
from plyx.kernel.attention import attention_hybrid, attention_reference

from .conftest import HAVE_TRITON, TRITON_DEVICE

ref_rmsnorm = importlib.import_module("plyx.kernel.reference.rmsnorm").rmsnorm


def _qkv(dtype: torch.dtype, device: str = "cpu", T: int = 16, D: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = ((2, T, 4, D), (2, T, 2, D), (2, T, 2, D))  # GQA 4/2
    return [torch.randn(*s, generator=g, dtype=torch.float32).to(device, dtype).requires_grad_(True) for s in shapes]


def _grads(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)  # the same for any dtype
    return list(torch.autograd.grad(out, leaves, dy))


# -- the hybrid implementation --------------------------------------------------------------------------------

@pytest.mark.skipif(not HAVE_TRITON, reason="the hybrid's packed-document side is the Triton kernel")
def test_hybrid_routes_plain_causal_to_sdpa_and_packed_documents_to_triton() -> None:
    """Plain causal calls take SDPA, packed documents the Triton flash kernel (interpreted on CPU); both equal
    the float64 reference (forward and q/k/v gradients) within bf16 tolerance."""
    hybrid_mod.ROUTES.clear()
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 9 + [1] * 7], device=TRITON_DEVICE)
    for kwargs, route in (({}, "sdpa"), ({"document_ids": docs}, "triton")):
        q, k, v = _qkv(torch.bfloat16, TRITON_DEVICE)
        before = hybrid_mod.ROUTES[route]
        out = attention_hybrid(q, k, v, causal=True, **kwargs)
        assert hybrid_mod.ROUTES[route] == before + 1, (route, dict(hybrid_mod.ROUTES))
        q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        want = attention_reference(q64, k64, v64, causal=True, **kwargs)
        scale = want.abs().max()
        assert (out.double() - want).abs().max() / scale < 2e-2, route
        for got, ref in zip(_grads(out.float(), [q, k, v]), _grads(want, [q64, k64, v64]), strict=True):
            assert (got.double() - ref).abs().max() / ref.abs().max() < 4e-2, route
    assert set(hybrid_mod.ROUTES) == {"sdpa", "triton"}


# -- the rule ---------------------------------------------------------------------------------------------------

def test_auto_on_cpu_traces_sdpa_and_inductor_norms() -> None:
    got = resolve_training_kernels("auto", "auto", device="cpu")
    assert (got.attention, got.compiled_attention, got.compiled_norms) == (None, "sdpa-all", "inductor")
    assert "cpu" in got.describe()
    assert resolve_training_kernels("sdpa", "kernel", device="cpu").attention == "sdpa"
    assert resolve_training_kernels("auto", "kernel", device="cpu").compiled_norms == "kernel"


@pytest.mark.parametrize(("cc", "dtype", "want"), [
    ((9, 0), torch.bfloat16, ("hybrid", "sdpa")),  # H100/H200: SDPA for unpacked batches
    ((8, 0), torch.bfloat16, (None, "op")),  # A100: the registry's Triton kernel, its custom op under compile
    ((9, 0), torch.float32, (None, "sdpa-all")),  # the Triton kernel refuses float32: SDPA traced
])
def test_auto_rule_on_cuda(cc: tuple[int, int], dtype: torch.dtype, want: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    from plyx.kernel import _training

    monkeypatch.setattr(_training, "_capability", lambda device: cc)
    got = resolve_training_kernels("auto", "auto", device="cuda", dtype=dtype)
    assert (got.attention, got.compiled_attention) == want
    forced = resolve_training_kernels("triton", "kernel", device="cuda", dtype=torch.bfloat16)
    assert (forced.attention, forced.compiled_attention, forced.compiled_norms) == ("triton", "op", "kernel")
    if dtype == torch.bfloat16:
        assert resolve_training_kernels("sdpa", device="cuda", dtype=dtype).attention == "hybrid"


def test_auto_keeps_an_attention_override_in_force() -> None:
    with registry().override(attention="reference"):
        got = resolve_training_kernels("auto", device="cpu")
    assert got.attention is None and "attention=reference" in got.reason


def test_bad_choices_fail_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"attention = 'triton' needs a CUDA GPU.*attention = 'auto'"):
        resolve_training_kernels("triton", device="cpu")
    with pytest.raises(ValueError, match="choose one of auto, sdpa, triton"):
        resolve_training_kernels("flash")
    with pytest.raises(ValueError, match="choose one of auto, kernel, inductor"):
        resolve_training_kernels("auto", "liger")


def test_training_kernels_scopes_the_override_and_the_compile_choice() -> None:
    before = dict(_custom_ops.COMPILE_CHOICES)
    with training_kernels("sdpa", "inductor", device="cpu") as chosen:
        assert registry().overrides()["attention"][0] == "sdpa"
        assert _custom_ops.COMPILE_CHOICES == {"attention": "sdpa-all", "rmsnorm": "inductor"}
        assert chosen.compiled_norms == "inductor"
    assert "attention" not in registry().overrides()
    assert _custom_ops.COMPILE_CHOICES == before


# -- the compile path -------------------------------------------------------------------------------------------

def _targets(fn, *args):
    """``fn(*args)`` compiled (aot_eager: the ATen graphs, forward and backward, are recorded) and its call targets."""
    from torch._dynamo.backends.common import aot_autograd

    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, example: object) -> object:
        from functorch.compile import make_boxed_func

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)(*args)
    return out, seen


def test_compiled_attention_traces_sdpa_with_the_references_gradients() -> None:
    """``sdpa-all`` (CPU): the compiled call is aten SDPA (its own autograd), no ``plyx::attention`` custom op and so
    no recompute; float64 values and gradients equal the reference's. ``op`` keeps the custom op."""
    call = _custom_ops.traceable("attention")
    docs = torch.tensor([[0] * 3 + [1] * 5, [0] * 8])
    for kwargs in ({}, {"document_ids": docs}):
        q, k, v = _qkv(torch.float64, T=8, D=8)
        want = attention_reference(q, k, v, causal=True, **kwargs)
        want_grads = _grads(want, [q, k, v])
        with training_kernels("auto", "auto", device="cpu"):
            out, seen = _targets(lambda q, k, v: call(q, k, v, causal=True, **kwargs), q, k, v)  # noqa: B023
            got_grads = _grads(out, [q, k, v])
        assert not [t for t in seen if t.startswith("plyx.")], sorted(set(seen))
        assert any("scaled_dot_product" in t for t in seen), sorted(set(seen))
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for got, ref in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    q, k, v = _qkv(torch.float64, T=8, D=8)
    _, seen = _targets(lambda q, k, v: call(q, k, v, causal=True), q, k, v)  # outside: the custom op
    assert "plyx.attention.default" in seen


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_compiled_norms_are_plain_ops_with_the_references_values(residual: bool, dtype: torch.dtype) -> None:
    """``compiled_norms = inductor``: RMSNorm (+ residual) traced as torch ops (no ``plyx::rmsnorm`` custom op), the
    reference's output, residual stream and gradients: float64 to accumulation order, bf16 bit-for-bit rounding of
    the same float32 statistics (equal within one bf16 ulp)."""
    g = torch.Generator().manual_seed(2)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
              for s in ((2, 5, 24), (24,), (2, 5, 24))]
    x, w, r = leaves
    kw = {"residual": r} if residual else {}
    used = leaves if residual else leaves[:2]
    want = ref_rmsnorm(x, w, eps=1e-5, **kw)
    call = _custom_ops.traceable("rmsnorm")
    with training_kernels("auto", "inductor", device="cpu"):
        got, seen = _targets(lambda *a: call(a[0], a[1], eps=1e-5, **({"residual": a[2]} if residual else {})), *used)
    assert not [t for t in seen if t.startswith("plyx.")], sorted(set(seen))
    outs = lambda o: list(o) if isinstance(o, tuple) else [o]  # noqa: E731
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-2}
    for a, b in zip(outs(got), outs(want), strict=True):
        torch.testing.assert_close(a, b, **tol)
    dy = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype) for o in outs(want)]
    got_g = torch.autograd.grad(outs(got), used, dy)
    want_g = torch.autograd.grad(outs(want), used, dy)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, **({"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else
                                            {"rtol": 2e-2, "atol": 2e-2}))
