"""The behavioural half of the contract gate: every discovered implementation through its kit, in one command."""

from __future__ import annotations

import pytest
import torch
from plyx.specs import hookimpl, plugins
from plyx.specs._gate import collect_kernels, run_conformance
from plyx.specs.kernels import Capability, KernelImpl


class _SwigluIgnoringDtype:
    """A plugin whose swiglu computes silu(gate) * up but returns float64: the gate must fail it."""

    @staticmethod
    @hookimpl
    def plyx_register_kernels(registry):
        def wide(gate, up):
            return torch.nn.functional.silu(gate.double()) * up.double()

        registry.register(KernelImpl("swiglu", "wide", wide, Capability(devices={"cpu"})), source="plyx-kernel 9.9")


def test_the_gate_runs_every_discovered_implementation_and_fails_a_bad_one(monkeypatch):
    monkeypatch.setenv("PLYX_PLUGINS", "kernel")  # plyx-kernel's own plugin, plus the one registered by hand
    plugins.reset_plugins()
    plugins.register_plugin(_SwigluIgnoringDtype, "wide-kernels", distribution="wide-kernels 0.1")
    try:
        impls = {(i.qualname, i.source) for i in collect_kernels()}
        assert ("swiglu:wide", "wide-kernels 0.1") in impls  # credited to its distribution, not its claim
        assert any(q == "rmsnorm:reference" and s.startswith("plyx-kernel") for q, s in impls)
        lines: list[str] = []
        assert run_conformance(device="cpu", echo=lines.append) == 1
        text = "\n".join(lines)
        assert "FAIL kernel swiglu:wide (wide-kernels 0.1)" in text and "has dtype torch.float64" in text
        assert "ok   kernel rmsnorm:reference" in text and "ok   plugin kernel" in text
    finally:
        plugins.unregister_plugin("wide-kernels")
        plugins.reset_plugins()


def test_a_contract_major_without_its_kit_fails_the_gate(monkeypatch):
    from plyx.specs import _gate

    pytest.importorskip("plyx.attn", reason="the kvcache implementations it gates come from plyx-attn")
    monkeypatch.setattr(_gate, "KITS", {**_gate.KITS, "kvcache": (0,)})  # as if kvcache had moved on to v1
    monkeypatch.setenv("PLYX_PLUGINS", "attn")
    plugins.reset_plugins()
    lines: list[str] = []
    try:
        assert run_conformance(device="cpu", echo=lines.append) == 1
    finally:
        plugins.reset_plugins()
    assert any("no conformance kit for the kvcache contract v1.0" in line for line in lines)
