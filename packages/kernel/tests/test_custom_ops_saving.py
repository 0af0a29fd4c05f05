"""The custom ops' backwards read what their forwards saved: the implementation's forward runs once per
forward+backward (issue 19: the compiled 1B step was slower than eager because every op re-ran its forward in
its backward), with float64 gradients equal to the eager registry call's and to ``gradcheck``'s numerics.

The Triton saving forwards and backwards run here in Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET``); through the registry (CPU) the ops take the references. The same tests run on CUDA.
"""

from __future__ import annotations

import importlib

import plyx.kernel as K
import pytest
import torch
from plyx.kernel import _saving, registry, rope_tables, traceable

from .conftest import HAVE_TRITON, TRITON_DEVICE

torch.manual_seed(0)
ref_rmsnorm = importlib.import_module("plyx.kernel.reference.rmsnorm")


def _r(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float64, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(True)


def _cases(dtype: torch.dtype = torch.float64, device: str = "cpu", head_dim: int = 8) -> dict[str, tuple]:
    """(kernel name, args, kwargs) per op; float64 leaves by default."""
    g = torch.Generator().manual_seed(3)
    cos, sin = rope_tables(torch.arange(5), head_dim, 10000.0)
    cos, sin = cos.to(device, dtype), sin.to(device, dtype)
    targets = torch.tensor([1, 3, -100, 6, 2, 0], device=device)
    r = lambda *s: _r(*s, g=g, dtype=dtype, device=device)  # noqa: E731
    return {
        "rmsnorm": ("rmsnorm", (r(2, 5, 12), r(12)), {"eps": 1e-5}),
        "rmsnorm_residual": ("rmsnorm", (r(2, 5, 12), r(12)), {"eps": 1e-5, "residual": r(2, 5, 12)}),
        "swiglu": ("swiglu", (r(3, 7), r(3, 7)), {}),
        "rope": ("rope", (r(2, 5, 3, head_dim), cos, sin), {}),
        "rope_qk": ("rope_qk", (r(2, 5, 4, head_dim), r(2, 5, 2, head_dim), cos, sin), {"interleaved": True}),
        "attention": ("attention", (r(2, 5, 4, head_dim), r(2, 5, 2, head_dim), r(2, 5, 2, head_dim)),
                      {"causal": True}),
        "attention_docs": ("attention", (r(2, 5, 4, head_dim), r(2, 5, 2, head_dim), r(2, 5, 2, head_dim)),
                           {"document_ids": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], device=device),
                            "window": 3}),
        "cross_entropy": ("cross_entropy", (r(6, 9), targets), {"label_smoothing": 0.1, "z_loss": 1e-3}),
        "cross_entropy_rows": ("cross_entropy", (r(6, 9), targets), {"reduction": "none"}),
        "linear_cross_entropy": ("linear_cross_entropy", (r(6, 4), r(9, 4), targets),
                                 {"bias": r(9), "reduction": "sum", "z_loss": 1e-3}),
        "linear_cross_entropy_mean": ("linear_cross_entropy", (r(6, 4), r(9, 4), targets), {"label_smoothing": 0.1}),
    }


def _op_of(case: str) -> str:
    name = _cases()[case][0]
    return "rmsnorm_residual" if case == "rmsnorm_residual" else name


def _leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]


def _weighted(out: object) -> torch.Tensor:
    """A loss that weights every output element differently (a wrong gradient cannot cancel out)."""
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype, device=o.device).view(o.shape)).sum()
               for o in outs)


@pytest.mark.parametrize("case", list(_cases()))
def test_forward_runs_once_per_forward_and_backward(case: str) -> None:
    """Attention on CPU defaults to ``sdpa`` (no saved statistics): the reference is forced here; the fallback
    has its own test below."""
    name, args, kwargs = _cases()[case]
    op = _op_of(case)
    with registry().override(attention="reference"):
        before = _saving.FORWARD_RUNS[op]
        out = traceable(name)(*args, **kwargs)
        assert _saving.FORWARD_RUNS[op] == before + 1
        torch.autograd.grad(_weighted(out), _leaves(args, kwargs))
        assert _saving.FORWARD_RUNS[op] == before + 1, f"{op}'s backward re-ran the forward"


def test_the_reference_rmsnorm_body_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at the implementation itself, independently of the op layer's counter."""
    runs = []
    original = ref_rmsnorm._Norm.forward

    def counting(ctx, h, weight, eps):  # type: ignore[no-untyped-def]
        runs.append(1)
        return original(ctx, h, weight, eps)

    monkeypatch.setattr(ref_rmsnorm._Norm, "forward", staticmethod(counting))
    _, args, kwargs = _cases()["rmsnorm_residual"]
    out = traceable("rmsnorm")(*args, **kwargs)
    torch.autograd.grad(_weighted(out), _leaves(args, kwargs))
    assert len(runs) == 1


def test_recompute_fallbacks_are_counted() -> None:
    """``sdpa`` attention keeps no log-sum-exp and ``reduction="none"`` linear cross-entropy gets its per-row
    factors only in the backward: both re-run their forward there (and still give the eager gradients)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _r(1, 4, 2, 8, g=g), _r(1, 4, 1, 8, g=g), _r(1, 4, 1, 8, g=g)
    before = _saving.FORWARD_RUNS["attention"]
    torch.autograd.grad(_weighted(traceable("attention")(q, k, v)), [q, k, v])
    assert _saving.FORWARD_RUNS["attention"] == before + 2
    h, w, t = _r(4, 3, g=g), _r(5, 3, g=g), torch.tensor([0, 4, -100, 2])
    before = _saving.FORWARD_RUNS["linear_cross_entropy"]
    got = torch.autograd.grad(_weighted(traceable("linear_cross_entropy")(h, w, t, reduction="none")), [h, w])
    assert _saving.FORWARD_RUNS["linear_cross_entropy"] == before + 2
    want = torch.autograd.grad(_weighted(K.linear_cross_entropy(h, w, t, reduction="none")), [h, w])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(_cases()))
def test_float64_gradients_equal_the_eager_call(case: str) -> None:
    name, args, kwargs = _cases()[case]
    leaves = _leaves(args, kwargs)
    with registry().override(attention="reference"):
        want = getattr(K, name)(*args, **kwargs)
        got = traceable(name)(*args, **kwargs)
        gw = torch.autograd.grad(_weighted(want), leaves)
        go = torch.autograd.grad(_weighted(got), leaves)
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                    strict=True):
        torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
    for a, b in zip(go, gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["rmsnorm_residual", "swiglu", "rope_qk", "attention_docs", "cross_entropy",
                                  "linear_cross_entropy"])
def test_gradcheck_through_the_ops(case: str) -> None:
    """Finite differences of the op (float64), through the saving backward."""
    name, args, kwargs = _cases()[case]
    leaves = _leaves(args, kwargs)

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        it = iter(xs)
        a = [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in args]
        kw = {k: (next(it) if isinstance(x, torch.Tensor) and x.requires_grad else x) for k, x in kwargs.items()}
        return _weighted(traceable(name)(*a, **kw))

    with registry().override(attention="reference"):
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_unused_output_and_incoming_gradient_scale() -> None:
    """rmsnorm's residual stream unused (no gradient arrives for it) and a loss scaled by 3 (the saved loss
    gradients are multiplied by the incoming one)."""
    _, (x, w), kwargs = _cases()["rmsnorm_residual"]
    y, _ = traceable("rmsnorm")(x, w, **kwargs)
    y_ref, _ = K.rmsnorm(x, w, **kwargs)
    for a, b in zip(torch.autograd.grad(_weighted(y), [x, w, kwargs["residual"]]),
                    torch.autograd.grad(_weighted(y_ref), [x, w, kwargs["residual"]]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    _, (h, wt, t), kw = _cases()["linear_cross_entropy_mean"]
    got = torch.autograd.grad(3.0 * traceable("linear_cross_entropy")(h, wt, t, **kw), [h, wt])
    want = torch.autograd.grad(3.0 * K.linear_cross_entropy(h, wt, t, **kw), [h, wt])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_no_gradient_call_saves_nothing() -> None:
    """Without gradients the fused loss computes no gradient buffers (the op's extras are empty)."""
    _, (h, w, t), kw = _cases()["linear_cross_entropy_mean"]
    with torch.no_grad():
        loss, *grads = torch.ops.plyx.linear_cross_entropy(h, w, t, None, -100, 0.1, 0.0, "mean", False)
    assert [g.numel() for g in grads] == [0, 0, 0]
    torch.testing.assert_close(loss, K.linear_cross_entropy(h.detach(), w.detach(), t, **kw), rtol=1e-12, atol=1e-12)


# -- the Triton saving forwards and backwards (interpreter on CPU, or CUDA) ------------------------------

_TRITON_CASES = ["rmsnorm", "rmsnorm_residual", "swiglu", "rope", "rope_qk", "attention", "attention_docs",
                 "cross_entropy", "cross_entropy_rows", "linear_cross_entropy_mean"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", _TRITON_CASES)
def test_triton_split_matches_its_autograd(case: str) -> None:
    """The Triton implementation's saving forward + backward (what the op runs on a GPU) give the values and
    gradients of the same implementation's eager autograd call, and of the float64 reference."""
    from plyx.kernel.attention import attention_triton
    from plyx.kernel.triton_ops._registration import _lazy

    dtype = torch.float16 if case.startswith("attention") and TRITON_DEVICE == "cuda" else torch.float32
    name, args, kwargs = _cases(dtype=dtype, device=TRITON_DEVICE, head_dim=16 if "attention" in case else 8)[case]
    op = _op_of(case)
    fn = attention_triton if name == "attention" else _lazy(name, name)
    split = _saving.split_for(op, fn)
    assert split.backward is not None
    positional = _positional(op, args, kwargs)
    leaves = _leaves(args, kwargs)
    with torch.no_grad():
        outs, extras = split.forward(*positional)
    want = fn(*args, **kwargs)
    wants = want if isinstance(want, tuple) else (want,)
    for o, w in zip(outs, wants, strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)  # the same kernel launch
    grads = [torch.linspace(0.5, 1.5, w.numel(), dtype=w.dtype, device=w.device).view(w.shape) for w in wants]
    keep = _saving.SAVED_OUTPUTS.get(op, ())
    with torch.no_grad():
        got = split.backward(grads, [outs[i] for i in keep], extras, positional)
    expected = torch.autograd.grad(wants, leaves, grads)
    got = [g for g in got if g is not None]
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tol)


def _positional(op: str, args: tuple, kwargs: dict) -> tuple:
    """The op's positional schema for a kernel call's arguments."""
    if op == "rmsnorm":
        return (*args, kwargs["eps"])
    if op == "rmsnorm_residual":
        return (*args, kwargs["residual"], kwargs["eps"])
    if op in ("rope", "rope_qk"):
        return (*args, bool(kwargs.get("interleaved", False)))
    if op == "attention":
        return (*args, kwargs.get("mask"), kwargs.get("document_ids"), kwargs.get("causal", True), None,
                kwargs.get("window"))
    if op == "cross_entropy":
        return (*args, -100, kwargs.get("label_smoothing", 0.0), kwargs.get("z_loss", 0.0),
                kwargs.get("reduction", "mean"))
    if op == "linear_cross_entropy":
        return (*args, kwargs.get("bias"), -100, kwargs.get("label_smoothing", 0.0), kwargs.get("z_loss", 0.0),
                kwargs.get("reduction", "mean"), True)
    return args


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", ["cross_entropy", "linear_cross_entropy"])
def test_triton_loss_backward_reads_no_scalar_on_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``loss.backward()`` through the eager Triton losses asks the host for no tensor value (on a GPU each such
    read is a sync inside the training step): counted on CPU, and the gradient still scales with the loss."""
    from plyx.kernel.triton_ops._registration import _lazy

    _, args, kwargs = _cases(dtype=torch.float32, device=TRITON_DEVICE)[
        "cross_entropy" if name == "cross_entropy" else "linear_cross_entropy_mean"]
    leaves = _leaves(args, kwargs)
    fn = _lazy(name, name)
    want = torch.autograd.grad(fn(*args, **kwargs), leaves)
    loss = 2.5 * fn(*args, **kwargs)
    reads: list[str] = []
    for method in ("__bool__", "item", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _m=method, _o=original, **k: reads.append(_m) or _o(self, *a, **k))
    got = torch.autograd.grad(loss, leaves)
    monkeypatch.undo()
    assert reads == []
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, 2.5 * b, rtol=1e-5, atol=1e-6)


def test_backward_selects_the_implementation_of_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward re-selects for its saved arguments, some of them placeholders of unsaved inputs (RMSNorm's x
    and residual): a size-limited implementation must be chosen again, not the reference."""
    from plyx.kernel.reference import rmsnorm as reference_rmsnorm
    from plyx.specs import Capability, KernelImpl

    def narrow(x, weight, *, eps=1e-6, residual=None):  # type: ignore[no-untyped-def]
        return reference_rmsnorm(x, weight, eps=eps, residual=residual)

    reg = registry()
    reg.register(KernelImpl("rmsnorm", "test-narrow", narrow, capability=Capability(shape_limits={"hidden": (1, 64)}),
                            priority=1000, description="test"))
    try:
        seen: list[object] = []
        real = _saving.split_for
        monkeypatch.setattr(_saving, "split_for", lambda op, fn: seen.append(fn) or real(op, fn))
        _, args, kwargs = _cases()["rmsnorm_residual"]
        out = traceable("rmsnorm")(*args, **kwargs)
        torch.autograd.grad(_weighted(out), _leaves(args, kwargs))
        assert seen == [narrow, narrow]
    finally:
        reg.unregister("rmsnorm", "test-narrow")
