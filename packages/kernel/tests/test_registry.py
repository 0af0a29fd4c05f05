"""Selection: predicates, priorities, determinism, caching, overrides, strict mode, explanations, errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from plyx.kernel import KernelConformanceWarning, KernelFallbackWarning, KernelInputError, Registry, query_for
from plyx.specs import KernelConfig
from plyx.specs.kernels import Capability, KernelImpl, KernelNotFoundError, KernelQuery, KernelUnavailableError


def _fn(tag):
    def fn(*args, **kwargs):
        return tag

    fn.__name__ = tag
    return fn


def _reg(*impls, **kwargs) -> Registry:
    reg = Registry(verify=False, **kwargs)
    for impl in impls:
        reg.register(impl)
    return reg


REF = KernelImpl("rmsnorm", "reference", _fn("ref"), priority=0)
FAST = KernelImpl("rmsnorm", "fast", _fn("fast"), Capability(devices={"cuda"}, dtypes={"bfloat16", "float32"},
                                                             min_compute_capability=(8, 0),
                                                             shape_limits={"hidden": (1, 8192)}), priority=10)
WIDE = KernelImpl("rmsnorm", "wide", _fn("wide"), Capability(devices={"cuda"}), priority=5)
CUDA_BF16 = KernelQuery(device_type="cuda", dtype="bfloat16", compute_capability=(9, 0), shape={"hidden": 4096})


def test_highest_priority_accepted_wins_and_explain_says_why():
    reg = _reg(REF, FAST, WIDE)
    assert reg.select("rmsnorm", CUDA_BF16).impl == "fast"
    lines = {c.impl.impl: (c.taken, c.reason) for c in reg.explain("rmsnorm", CUDA_BF16)}
    assert lines["fast"] == (True, "highest priority (10) among accepted")
    assert lines["wide"] == (False, "accepted, lower priority (5) than fast")
    cpu = KernelQuery(device_type="cpu", dtype="float32")
    assert reg.select("rmsnorm", cpu).impl == "reference"
    assert "refused: device 'cpu' not in ['cuda']" in {c.impl.impl: c.reason for c in reg.explain("rmsnorm", cpu)}["fast"]


@pytest.mark.parametrize("query,reason", [
    (KernelQuery(device_type="cuda", dtype="float16", compute_capability=(9, 0)), "dtype float16 not in"),
    (KernelQuery(device_type="cuda", dtype="bfloat16", compute_capability=(7, 5)), "compute capability (7, 5) below (8, 0)"),
    (KernelQuery(device_type="cuda", dtype="bfloat16", compute_capability=(9, 0), shape={"hidden": 16384}),
     "hidden=16384 above the maximum 8192"),
])
def test_each_predicate_refuses_with_its_reason(query, reason):
    reg = _reg(REF, FAST)
    assert reg.select("rmsnorm", query).impl == "reference"
    assert reason in {c.impl.impl: c.reason for c in reg.explain("rmsnorm", query)}["fast"]


def test_selection_does_not_depend_on_registration_order():
    a = KernelImpl("rmsnorm", "alpha", _fn("a"), priority=3)
    b = KernelImpl("rmsnorm", "beta", _fn("b"), priority=3)
    assert _reg(a, b).select("rmsnorm", CUDA_BF16).impl == _reg(b, a).select("rmsnorm", CUDA_BF16).impl == "alpha"


def test_choice_is_cached_per_shape_class_and_rechecked_at_the_exact_size():
    calls = []
    impl = KernelImpl("rmsnorm", "counted", _fn("c"), Capability(check=lambda q: calls.append(q) or None), priority=1)
    reg = _reg(REF, impl)
    q = KernelQuery(device_type="cpu", dtype="float32", shape={"hidden": 4000})
    reg.select("rmsnorm", q)
    reg.select("rmsnorm", KernelQuery(device_type="cpu", dtype="float32", shape={"hidden": 4090}))
    assert len(calls) == 2  # the cached choice's shape predicates are re-checked, nothing else runs
    limited = KernelImpl("rmsnorm", "limited", _fn("l"), Capability(shape_limits={"hidden": (None, 4000)}), priority=2)
    reg.register(limited)  # registering clears the cache
    assert reg.select("rmsnorm", q).impl == "limited"
    # 4090 is in the same power-of-two class as 4000 but above the limit: not served from the cache
    assert reg.select("rmsnorm", KernelQuery(device_type="cpu", dtype="float32", shape={"hidden": 4090})).impl == "counted"


def test_overrides_context_env_and_config_in_that_order(monkeypatch):
    reg = _reg(REF, FAST, WIDE, config=KernelConfig(overrides={"rmsnorm": "wide"}))
    assert reg.select("rmsnorm", CUDA_BF16).impl == "wide"
    monkeypatch.setenv("PLYX_KERNELS", "rmsnorm=reference, rope=triton")
    assert reg.select("rmsnorm", CUDA_BF16).impl == "reference"
    with reg.override(rmsnorm="fast"):
        assert reg.select("rmsnorm", CUDA_BF16).impl == "fast"
        with reg.override(rmsnorm="wide"):
            assert reg.select("rmsnorm", CUDA_BF16).impl == "wide"
        taken = next(c for c in reg.explain("rmsnorm", CUDA_BF16) if c.taken)
        assert taken.reason == "forced by registry.override()"
    assert reg.select("rmsnorm", CUDA_BF16).impl == "reference"
    monkeypatch.delenv("PLYX_KERNELS")
    reg.configure(KernelConfig())
    assert reg.select("rmsnorm", CUDA_BF16).impl == "fast"


def test_override_that_refuses_falls_back_with_a_warning_or_raises_in_strict_mode(monkeypatch):
    reg = _reg(REF, FAST)
    cpu = KernelQuery(device_type="cpu", dtype="float32")
    with reg.override(rmsnorm="fast"), pytest.warns(KernelFallbackWarning, match=r"forces 'fast'.*device 'cpu'"):
        assert reg.select("rmsnorm", cpu).impl == "reference"
    reg.configure(KernelConfig(strict=True))
    with reg.override(rmsnorm="fast"), pytest.raises(KernelUnavailableError, match=r"rmsnorm.*forces 'fast'.*strict"):
        reg.select("rmsnorm", cpu)
    with reg.override(rmsnorm="fast"):  # explain still answers, and says strict mode would raise
        assert "strict mode would raise" in next(c for c in reg.explain("rmsnorm", cpu) if c.taken).reason
    reg.configure(KernelConfig())
    monkeypatch.setenv("PLYX_KERNELS_STRICT", "1")
    with reg.override(rmsnorm="fast"), pytest.raises(KernelUnavailableError):
        reg.select("rmsnorm", cpu)


def test_disabled_implementations_are_never_chosen():
    reg = _reg(REF, FAST, config=KernelConfig(disabled=["rmsnorm:fast"]))
    assert reg.select("rmsnorm", CUDA_BF16).impl == "reference"
    assert "disabled by KernelConfig.disabled" in {c.impl.impl: c.reason for c in reg.explain("rmsnorm", CUDA_BF16)}["fast"]


def test_unknown_names_and_implementations_are_clear_errors(monkeypatch):
    reg = _reg(REF)
    with pytest.raises(KernelNotFoundError, match=r"kernel 'rmsnrom' not found\. It is either misspelled or not installed"):
        reg.select("rmsnrom", CUDA_BF16)
    with reg.override(rmsnorm="triton"), pytest.raises(KernelNotFoundError, match=r"no implementation 'triton'.*reference"):
        reg.select("rmsnorm", CUDA_BF16)
    monkeypatch.setenv("PLYX_KERNELS", "rmsnorm")
    with pytest.raises(ValueError, match="PLYX_KERNELS=rmsnorm=reference"):
        reg.select("rmsnorm", CUDA_BF16)


def test_nothing_accepts_is_an_error_listing_every_refusal():
    reg = _reg(FAST)
    with pytest.raises(KernelUnavailableError, match=r"no implementation of kernel 'rmsnorm' accepts cpu float32.*fast: device"):
        reg.select("rmsnorm", KernelQuery(device_type="cpu", dtype="float32"))


def test_duplicate_registration_names_both_sources_but_reentry_is_harmless():
    reg = Registry(verify=False)
    reg.register(REF, source="plyx-kernel 1.0.0")
    reg.register(REF, source="plyx-kernel 1.0.0")  # the same hook run again
    with pytest.raises(KernelUnavailableError, match=r"registered twice: by plyx-kernel 1.0.0 and by acme-kernels 2.0"):
        reg.register(KernelImpl("rmsnorm", "reference", _fn("other")), source="acme-kernels 2.0")


def test_registration_validates_its_argument():
    reg = Registry(verify=False)
    with pytest.raises(TypeError, match="KernelImpl"):
        reg.register(_fn("x"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without ':'"):
        reg.register(KernelImpl("rmsnorm", "a:b", _fn("x")))


def test_get_reads_device_dtype_sizes_and_grad_from_tensors():
    reg = _reg(REF, KernelImpl("rmsnorm", "narrow", _fn("narrow"), Capability(shape_limits={"hidden": (None, 64)},
                                                                              dtypes={"float32"}), priority=1))
    assert reg.get("rmsnorm", torch.ones(2, 64))() == "narrow"
    assert reg.get("rmsnorm", torch.ones(2, 65))() == "ref"
    assert reg.get("rmsnorm", torch.ones(2, 64, dtype=torch.float64))() == "ref"
    assert reg.get("rmsnorm", torch.ones(2, 65), hidden=8)() == "narrow"  # explicit sizes win
    q = query_for("linear_cross_entropy", torch.ones(3, 16, requires_grad=True), torch.ones(100, 16))
    assert (q.shape, q.requires_grad, q.dtype, q.device_type) == ({"hidden": 16, "vocab": 100}, True, "float32", "cpu")
    with torch.no_grad():
        assert not query_for("rmsnorm", torch.ones(3, requires_grad=True)).requires_grad
    assert query_for("rope", torch.ones(1, 2, 3, 128)).shape == {"head_dim": 128}


def test_get_refuses_mixed_devices_and_no_tensors():
    reg = _reg(REF)
    with pytest.raises(KernelInputError, match=r"rmsnorm.*`tensors\[1\]`.*meta"):
        reg.get("rmsnorm", torch.ones(2), torch.ones(2, device="meta"))
    with pytest.raises(KernelUnavailableError, match="at least one tensor"):
        reg.get("rmsnorm")


def test_backward_predicate_follows_requires_grad():
    fwd_only = KernelImpl("rmsnorm", "fwd", _fn("fwd"), Capability(backward=False), priority=9)
    reg = _reg(REF, fwd_only)
    assert reg.get("rmsnorm", torch.ones(4, 4))() == "fwd"
    assert reg.get("rmsnorm", torch.ones(4, 4, requires_grad=True))() == "ref"


def test_third_party_kernel_failing_conformance_is_refused_and_reported():
    def broken_swiglu(gate, up):
        return gate * up  # forgot the silu

    reg = Registry(verify=True)
    reg.register(KernelImpl("swiglu", "reference", lambda g, u: torch.nn.functional.silu(g) * u), source="plyx-kernel 1.0.0")
    reg.register(KernelImpl("swiglu", "acme", broken_swiglu, priority=50), source="acme-kernels 0.1")
    with pytest.warns(KernelConformanceWarning, match=r"swiglu:acme from acme-kernels 0.1 failed conformance"):
        chosen = reg.get("swiglu", torch.ones(3, 4))
    assert chosen is not broken_swiglu
    reason = {c.impl.impl: c.reason for c in reg.explain("swiglu", KernelQuery(device_type="cpu", dtype="float32"))}["acme"]
    assert reason.startswith("refused: failed conformance: swiglu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is cached: probed (and warned about) once
        reg.get("swiglu", torch.ones(3, 4))


def test_third_party_kernel_passing_conformance_is_used():
    def good_swiglu(gate, up):
        return (torch.nn.functional.silu(gate.double()) * up.double()).to(gate.dtype)

    reg = Registry(verify=True)
    reg.register(KernelImpl("swiglu", "acme", good_swiglu, priority=50), source="acme-kernels 0.1")
    assert reg.get("swiglu", torch.ones(3, 4)) is good_swiglu
