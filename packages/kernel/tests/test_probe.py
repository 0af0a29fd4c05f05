"""The runtime conformance probe: every case inside the capability, per (device, dtype, grad), trusted by distribution."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from plyx.kernel import KernelConformanceWarning, Registry, reference
from plyx.kernel import _registry as registry_module
from plyx.kernel._default import populate
from plyx.specs import hookimpl, plugins
from plyx.specs.kernels import Capability, KernelImpl, KernelQuery

REF = "plyx-kernel 1.3.0"


def _registry(*impls: tuple[KernelImpl, str]) -> Registry:
    reg = Registry(verify=True)
    for impl, source in impls:
        reg.register(impl, source=source)
    return reg


def _ref(name: str) -> tuple[KernelImpl, str]:
    return KernelImpl(name, "reference", getattr(reference, name)), REF


def _reason(reg: Registry, name: str, impl: str, **query: object) -> str:
    q = KernelQuery(**{"device_type": "cpu", "dtype": "float32", **query})
    return {c.impl.impl: c.reason for c in reg.explain(name, q)}[impl]


def test_a_kernel_wrong_only_on_the_residual_path_is_refused():
    def no_residual_norm(x, w, *, eps=1e-6, residual=None):
        y = reference.rmsnorm(x, w, eps=eps)
        return y if residual is None else (y, x + residual)  # normalises x, not x + residual

    reg = _registry(_ref("rmsnorm"), (KernelImpl("rmsnorm", "acme", no_residual_norm, priority=9), "acme 0.1"))
    with pytest.warns(KernelConformanceWarning, match="residual"):
        assert reg.get("rmsnorm", torch.ones(2, 8)) is reference.rmsnorm


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return dy * u * torch.sigmoid(g), dy * g  # both gradients wrong


def test_the_verdict_is_per_grad_a_wrong_backward_is_refused_when_gradients_are_needed():
    def acme(g, u):
        return _WrongBackward.apply(g, u)

    reg = _registry(_ref("swiglu"), (KernelImpl("swiglu", "acme", acme, priority=9), "acme 0.1"))
    x = torch.randn(3, 8)
    assert reg.get("swiglu", x, x) is acme  # no grad: the forward is right
    leaf = x.clone().requires_grad_(True)
    with pytest.warns(KernelConformanceWarning, match="gradient of argument"):
        assert reg.get("swiglu", leaf, leaf) is reference.swiglu
    assert "gradient of argument" in _reason(reg, "swiglu", "acme", requires_grad=True)
    assert _reason(reg, "swiglu", "acme").startswith("highest priority")


def test_a_name_without_cases_is_not_trusted_unchecked():
    reg = _registry((KernelImpl("gemv", "reference", reference.gemv), REF),
                    (KernelImpl("gemv", "acme", lambda x, w, b=None: x @ w.T, priority=9), "acme 0.1"))
    with pytest.warns(KernelConformanceWarning, match="no conformance cases"):
        assert reg.get("gemv", torch.ones(2, 4), torch.ones(3, 4)) is reference.gemv


def test_an_output_wider_than_the_input_dtype_is_refused():
    def wide(a, b):
        return a.double() @ b.double()  # float64 for bfloat16: not the contract's dtype

    reg = _registry(_ref("matmul"), (KernelImpl("matmul", "acme", wide, priority=9), "acme 0.1"))
    with pytest.warns(KernelConformanceWarning, match="has dtype torch.float64"):
        chosen = reg.get("matmul", torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16))
    assert chosen is reference.matmul


def test_a_one_percent_bias_in_bfloat16_is_refused():
    def biased(g, u):
        return (reference.swiglu(g, u).float() * 1.01).to(g.dtype)

    reg = _registry(_ref("swiglu"), (KernelImpl("swiglu", "acme", biased, priority=9), "acme 0.1"))
    with pytest.warns(KernelConformanceWarning, match="off by"):
        assert reg.get("swiglu", torch.ones(2, 8, dtype=torch.bfloat16)) is reference.swiglu


def test_cases_outside_the_declared_capability_are_not_run():
    def aligned_only(g, u):
        if g.shape[-1] % 64:
            raise ValueError("hidden must be a multiple of 64")
        return reference.swiglu(g, u)

    cap = Capability(shape_multiple_of={"hidden": 64})
    reg = _registry(_ref("swiglu"), (KernelImpl("swiglu", "acme", aligned_only, cap, priority=9), "acme 0.1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelConformanceWarning)
        assert reg.get("swiglu", torch.ones(2, 128)) is aligned_only


def test_eight_racing_threads_probe_once(monkeypatch):
    calls = []
    real = registry_module.probe

    def counting(*args, **kwargs):
        calls.append(args[0].qualname)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_module, "probe", counting)

    def good(g, u):
        return reference.swiglu(g, u)

    reg = _registry(_ref("swiglu"), (KernelImpl("swiglu", "acme", good, priority=9), "acme 0.1"))
    barrier = threading.Barrier(8)
    chosen = []

    def worker():
        barrier.wait()
        chosen.append(reg.get("swiglu", torch.ones(2, 8)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["swiglu:acme"] and chosen == [good] * 8


def test_changing_plyx_kernels_verify_takes_effect(monkeypatch):
    def broken(g, u):
        return g * u

    reg = Registry()  # verify=None: follows the environment
    reg.register(*_ref("swiglu")[:1], source=REF)
    reg.register(KernelImpl("swiglu", "acme", broken, priority=9), source="acme 0.1")
    x = torch.ones(2, 8)
    monkeypatch.setenv("PLYX_KERNELS_VERIFY", "0")
    assert reg.get("swiglu", x) is broken  # trusted on request
    monkeypatch.setenv("PLYX_KERNELS_VERIFY", "1")
    with pytest.warns(KernelConformanceWarning):
        assert reg.get("swiglu", x) is reference.swiglu
    monkeypatch.setenv("PLYX_KERNELS_VERIFY", "0")
    assert reg.get("swiglu", x) is broken


def test_trust_comes_from_the_entry_points_distribution_not_the_plugins_claim(monkeypatch):
    def broken(g, u):
        return g * u

    class Impostor:
        @staticmethod
        @hookimpl
        def plyx_register_kernels(registry):
            registry.register(KernelImpl("swiglu", "fast", broken, priority=99, source="plyx-kernel 1.2.0"),
                              source="plyx-kernel 1.2.0")

    monkeypatch.delenv("PLYX_KERNELS_VERIFY", raising=False)
    plugins.register_plugin(Impostor, "impostor", distribution="impostor-kernels 6.6")
    try:
        reg = populate(Registry())
        impl = next(i for i in reg.implementations("swiglu") if i.impl == "fast")
        assert impl.source == "impostor-kernels 6.6"
        with pytest.warns(KernelConformanceWarning, match="swiglu:fast from impostor-kernels 6.6 failed conformance"):
            assert reg.get("swiglu", torch.ones(2, 8)) is not broken
    finally:
        plugins.unregister_plugin("impostor")


def test_the_refusal_warning_points_at_the_plugins_kernel():
    def broken(g, u):
        return g * u

    reg = _registry(_ref("swiglu"), (KernelImpl("swiglu", "acme", broken, priority=9), "acme 0.1"))
    with pytest.warns(KernelConformanceWarning) as caught:
        reg.get("swiglu", torch.ones(2, 8))
    assert caught[0].filename == __file__ and caught[0].lineno == broken.__code__.co_firstlineno
