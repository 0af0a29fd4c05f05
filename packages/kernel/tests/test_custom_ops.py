"""The torch.compile layer: each kernel as a ``plyx::`` custom op (opcheck of the schema, fake and autograd
registrations), gradients equal to the eager registry call's, and no graph break under ``fullgraph=True``.

On CPU the registry chooses the reference implementations inside the ops; what is tested here is the op
layer itself (shapes of the fake implementations, the recompute backward, aliasing), which is the same code
whichever implementation the registry picks on a GPU.
"""

from __future__ import annotations

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import rope_tables, traceable
from plyx.kernel._custom_ops import OPS

torch.manual_seed(0)


def _inputs() -> dict[str, tuple[tuple[object, ...], dict[str, object]]]:
    """Arguments per op (float64 leaves: gradients are compared exactly up to rounding)."""
    g = torch.Generator().manual_seed(1)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    cos, sin = rope_tables(torch.arange(5), 8, 10000.0)
    targets = torch.tensor([1, 3, -100, 6, 2, 0])
    return {
        "rmsnorm": ((r(2, 5, 12), r(12)), {"eps": 1e-5}),
        "rmsnorm_residual": ((r(2, 5, 12), r(12)), {"eps": 1e-5, "residual": r(2, 5, 12)}),
        "swiglu": ((r(3, 7), r(3, 7)), {}),
        "rope": ((r(2, 5, 3, 8), cos.double(), sin.double()), {}),
        "rope_qk": ((r(2, 5, 4, 8), r(2, 5, 2, 8), cos.double(), sin.double()), {"interleaved": True}),
        "attention": ((r(2, 5, 4, 8), r(2, 5, 2, 8), r(2, 5, 2, 8)), {"causal": True}),
        "attention_docs": ((r(2, 5, 4, 8), r(2, 5, 2, 8), r(2, 5, 2, 8)),
                           {"document_ids": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]), "window": 3}),
        "cross_entropy": ((r(6, 9), targets), {"label_smoothing": 0.1, "z_loss": 1e-3}),
        "linear_cross_entropy": ((r(6, 4), r(9, 4), targets), {"bias": r(9), "reduction": "sum"}),
    }


def _kernel_name(case: str) -> str:
    return {"rmsnorm_residual": "rmsnorm", "attention_docs": "attention"}.get(case, case)


def _eager(name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    if name == "attention":
        return K.attention(*args, **kwargs)
    return getattr(K, name)(*args, **kwargs)


def _grads(out: object, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
    return list(torch.autograd.grad(total, leaves))


@pytest.mark.parametrize("case", list(_inputs()))
def test_op_matches_eager_registry_call(case: str) -> None:
    args, kwargs = _inputs()[case]
    name = _kernel_name(case)
    leaves = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    want = _eager(name, args, kwargs)
    got = traceable(name)(*args, **kwargs)
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                    strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype
        torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
    for gw, go in zip(_grads(want, leaves), _grads(got, leaves), strict=True):
        torch.testing.assert_close(go, gw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", list(_inputs()))
def test_opcheck(case: str) -> None:
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch, as torch checks them."""
    args, kwargs = _inputs()[case]
    name = _kernel_name(case)
    op = {"rmsnorm_residual": "rmsnorm_residual"}.get(case, name)
    if op == "rmsnorm":
        positional = (args[0], args[1], kwargs["eps"])
    elif op == "rmsnorm_residual":
        positional = (args[0], args[1], kwargs["residual"], kwargs["eps"])
    elif op == "swiglu":
        positional = args
    elif op == "rope":
        positional = (*args, False)
    elif op == "rope_qk":
        positional = (*args, True)
    elif op == "attention":
        positional = (*args, kwargs.get("mask"), kwargs.get("document_ids"), True, None, kwargs.get("window"))
    elif op == "cross_entropy":
        positional = (*args, -100, kwargs["label_smoothing"], kwargs["z_loss"], "mean")
    else:
        positional = (*args, kwargs["bias"], -100, 0.0, 0.0, kwargs["reduction"], True)
    torch.library.opcheck(OPS[op], positional)


def _block(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A miniature pre-norm block through every traceable op, as model code calls them."""
    B, T, D = x.shape
    h = traceable("rmsnorm")(x, w, eps=1e-5)
    q = (h @ wq).view(B, T, 4, D // 4)  # (B, T, H, Dh)
    q = traceable("rope")(q, cos, sin)
    q, k = traceable("rope_qk")(q, q[:, :, :2] * 0.5, cos, sin)
    a = traceable("attention")(q, k, q[:, :, 2:], causal=True).reshape(B, T, D)
    y, h = traceable("rmsnorm")(a, w, eps=1e-5, residual=x)
    m = traceable("swiglu")(y, y * 0.5) + h
    flat = m.reshape(B * T, D)
    return traceable("linear_cross_entropy")(flat, head, targets) + traceable("cross_entropy")(flat @ head.T, targets)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_without_graph_breaks_equals_eager(backend: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # hermetic: Inductor's C++ cache
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    wq = (0.3 * torch.randn(16, 16, generator=g)).requires_grad_()
    head = (0.3 * torch.randn(11, 16, generator=g)).requires_grad_()
    targets = torch.randint(0, 11, (12,), generator=g)
    cos, sin = rope_tables(torch.arange(6), 4, 10000.0)
    leaves = [x, w, wq, head]
    want = _block(x, w, wq, head, targets, cos, sin)
    gw = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(_block)(x, w, wq, head, targets, cos, sin)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(_block, backend=backend, fullgraph=True)  # fullgraph: a graph break raises
    got = compiled(x, w, wq, head, targets, cos, sin)
    go = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(go, gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ops_stay_opaque_in_the_graph() -> None:
    """The compiled graph calls ``plyx::`` ops: Dynamo did not trace into an implementation."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.compile(lambda a, b: traceable("rmsnorm")(a, b) * 2, backend=backend, fullgraph=True)(x, w)
    assert any("plyx.rmsnorm" in s for s in seen), seen


def test_attention_lse_is_refused_with_the_fix() -> None:
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(NotImplementedError, match="return_lse"):
        traceable("attention")(q, q, q, return_lse=True)
    assert traceable("rope_store_kv") is None


def test_export_keeps_the_implementation_ops() -> None:
    """``torch.export`` (ONNX export's tracer) must not see ``plyx::`` ops: ``traceable`` steps aside."""

    class Norm(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fn = traceable("rmsnorm") if torch.compiler.is_compiling() else None
            return (fn or K.rmsnorm)(x, torch.ones(x.shape[-1]))

    program = torch.export.export(Norm(), (torch.randn(2, 8),))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("plyx" in t for t in targets), targets
