"""``get``'s fast cache: it always returns what ``select(name, query_for(...))`` returns.

Each check calls ``get`` twice (a miss, then a hit of the fast cache) and
compares both with a fresh ``select`` on the ``KernelQuery``, across overrides
(blocks, ``PLYX_KERNELS``, ``KernelConfig``), strict mode, registrations and
unregistrations, disabled implementations, grad, dtypes and sizes on both
sides of a shape limit inside one power-of-two shape class.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelFallbackWarning, Registry, query_for
from plyx.kernel._registry import FAST_CACHE_LIMIT
from plyx.specs import KernelConfig
from plyx.specs.kernels import Capability, KernelImpl, KernelUnavailableError


def _fn(tag):
    def fn(*args, **kwargs):
        return tag

    fn.__name__ = tag
    return fn


def _reg(*impls: KernelImpl) -> Registry:
    reg = Registry(verify=False)
    for impl in impls:
        reg.register(impl)
    return reg


REF = KernelImpl("rmsnorm", "reference", _fn("ref"))
# accepts hidden <= 100: 100 and 120 share the shape class 128, so a class-keyed answer would be wrong for one
NARROW = KernelImpl("rmsnorm", "narrow", _fn("narrow"), Capability(shape_limits={"hidden": (None, 100)},
                                                                   dtypes={"float32"}), priority=5)
FWD = KernelImpl("rmsnorm", "fwd", _fn("fwd"), Capability(backward=False), priority=3)
SWI_REF = KernelImpl("swiglu", "reference", _fn("swi-ref"))


def _same(reg: Registry, name: str, *tensors: torch.Tensor, **shape: int) -> str:
    """get() on a miss and on a hit equals select() on the query; returns the chosen tag."""
    first = reg.get(name, *tensors, **shape)
    second = reg.get(name, *tensors, **shape)
    expected = reg.select(name, query_for(name, *tensors, **shape)).fn
    assert first is second is expected, (first(), second(), expected())
    return first()


def test_fast_path_follows_exact_sizes_within_a_shape_class():
    reg = _reg(REF, NARROW)
    assert _same(reg, "rmsnorm", torch.ones(2, 120)) == "ref"  # first of class 128: refused by narrow
    assert _same(reg, "rmsnorm", torch.ones(2, 100)) == reg.select("rmsnorm", query_for("rmsnorm", torch.ones(2, 100))).fn()
    assert _same(reg, "rmsnorm", torch.ones(3, 120)) == "ref"
    assert _same(reg, "rmsnorm", torch.ones(2, 120), hidden=64) == "narrow"  # explicit sizes are part of the key
    assert _same(reg, "rmsnorm", torch.ones(2, 64, dtype=torch.float64)) == "ref"  # dtype is part of the key


def test_fast_path_follows_grad():
    reg = _reg(REF, FWD)
    assert _same(reg, "rmsnorm", torch.ones(4, 4)) == "fwd"
    x = torch.ones(4, 4, requires_grad=True)
    assert _same(reg, "rmsnorm", x) == "ref"
    with torch.no_grad():
        assert _same(reg, "rmsnorm", x) == "fwd"
    assert _same(reg, "rmsnorm", torch.ones(4, 4), torch.ones(4, requires_grad=True)) == "ref"  # any tensor's grad


def test_fast_path_follows_overrides_blocks_env_and_config(monkeypatch):
    reg = _reg(REF, NARROW, FWD)
    x = torch.ones(2, 64)
    assert _same(reg, "rmsnorm", x) == "narrow"
    with reg.override(rmsnorm="fwd"):
        assert _same(reg, "rmsnorm", x) == "fwd"
        with reg.override(rmsnorm="reference"):
            assert _same(reg, "rmsnorm", x) == "ref"
        assert _same(reg, "rmsnorm", x) == "fwd"
    assert _same(reg, "rmsnorm", x) == "narrow"
    monkeypatch.setenv("PLYX_KERNELS", "rmsnorm=reference")
    assert _same(reg, "rmsnorm", x) == "ref"
    monkeypatch.delenv("PLYX_KERNELS")
    reg.configure(KernelConfig(overrides={"rmsnorm": "fwd"}))
    assert _same(reg, "rmsnorm", x) == "fwd"
    reg.configure(KernelConfig(disabled=("narrow", "fwd")))
    assert _same(reg, "rmsnorm", x) == "ref"
    reg.configure(KernelConfig())
    assert _same(reg, "rmsnorm", x) == "narrow"


def test_fast_path_keeps_fallback_warnings_and_strict_mode(monkeypatch):
    reg = _reg(REF, NARROW)
    big = torch.ones(2, 500)
    with reg.override(rmsnorm="narrow"), pytest.warns(KernelFallbackWarning, match="forces 'narrow'"):
        assert reg.get("rmsnorm", big)() == "ref"
    monkeypatch.setenv("PLYX_KERNELS_STRICT", "1")  # an environment change reaches the cached path
    with reg.override(rmsnorm="narrow"), pytest.raises(KernelUnavailableError, match="strict"):
        reg.get("rmsnorm", big)


def test_fast_path_sees_new_registrations_and_removals():
    reg = _reg(REF, SWI_REF)
    x = torch.ones(2, 64)
    assert _same(reg, "rmsnorm", x) == "ref" and _same(reg, "swiglu", x, x) == "swi-ref"
    reg.register(NARROW)
    assert _same(reg, "rmsnorm", x) == "narrow"
    reg.register(KernelImpl("swiglu", "best", _fn("swi-best"), priority=7))  # a name without shape predicates
    assert _same(reg, "swiglu", x, x) == "swi-best"
    reg.unregister("rmsnorm", "narrow")
    assert _same(reg, "rmsnorm", x) == "ref"
    reg.unregister("swiglu", "best")
    assert _same(reg, "swiglu", x, x) == "swi-ref"


def test_fast_path_is_bounded_and_errors_still_raise():
    reg = _reg(REF, NARROW)
    for n in range(1, FAST_CACHE_LIMIT + 10):  # every shape a new key
        reg.get("rmsnorm", torch.empty(n, 8))
    assert len(reg._fast) <= FAST_CACHE_LIMIT
    assert _same(reg, "rmsnorm", torch.ones(2, 8)) == "narrow"
    with pytest.raises(KernelUnavailableError, match="at least one tensor"):
        reg.get("rmsnorm")
    with pytest.raises(ValueError, match="tensors\\[1\\]"):
        reg.get("rmsnorm", torch.ones(2), torch.ones(2, device="meta"))
