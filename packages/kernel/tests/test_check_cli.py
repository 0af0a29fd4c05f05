"""``plyx kernels check [DIST|MODULE]``: a report per kernel, dtype, device and direction; exit 1 on a failure."""

from __future__ import annotations

import textwrap

import pytest
from plyx.specs import plugins
from plyx.specs.cli import main

PLUGIN = """
    import torch
    from plyx.specs import hookimpl
    from plyx.specs.kernels import Capability, KernelImpl

    def good(gate, up):
        return torch.nn.functional.silu(gate) * up

    def wrong_backward(gate, up):
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, g, u):
                ctx.save_for_backward(g, u)
                return torch.nn.functional.silu(g) * u

            @staticmethod
            def backward(ctx, dy):
                g, u = ctx.saved_tensors
                return dy * u, dy * g  # forgot silu's derivative and silu itself
        return F.apply(gate, up)

    @hookimpl
    def plyx_register_kernels(registry):
        registry.register(KernelImpl("swiglu", "good", good, Capability(devices={"cpu"})))
        registry.register(KernelImpl("swiglu", "wrongbwd", wrong_backward, Capability(devices={"cpu"})))
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "tmp_check_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "tmp_check_kernels-0.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tmp-check-kernels\nVersion: 0.2\n")
    (info / "entry_points.txt").write_text("[plyx]\ntmp_check = tmp_check_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PLYX_PLUGINS", "kernel")  # the scan itself loads only plyx-kernel
    plugins.reset_plugins()
    yield "tmp_check_plugin"
    plugins.reset_plugins()


@pytest.mark.parametrize("target", ["tmp_check_plugin", "tmp-check-kernels"])
def test_check_reports_each_kernel_dtype_and_direction(plugin_module, target, capsys):
    code = main(["kernels", "check", target, "--device", "cpu", "--dtype", "float32", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 1
    assert "PASS swiglu:good" in out and "FAIL swiglu:wrongbwd" in out
    assert "pass float32  cpu  backward swiglu [4, 128]" in out
    assert "fail bfloat16 cpu  backward swiglu [5, 67]" in out
    assert "gradient of argument 0 off by" in out
    assert "1/2 implementation(s) conform" in out
    if target == "tmp-check-kernels":
        assert "distribution tmp-check-kernels 0.2" in out


def test_check_names_an_unknown_target(plugin_module, capsys):
    assert main(["kernels", "check", "no-such-thing-anywhere"]) == 2
    assert "neither an installed distribution nor an importable module" in capsys.readouterr().out
