"""The default registry, the dispatch functions, the CLI, and a kernel plugin discovered through the entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import plyx.kernel as K
import pytest
import torch
from plyx.specs import cli, plugins
from plyx.specs.kernels import KernelUnavailableError

from .conftest import HAVE_TRITON

PLYX = [sys.executable, "-m", "plyx.specs"]


def test_registry_is_one_per_process_and_holds_every_builtin():
    reg = K.registry()
    assert reg is K.registry()
    assert {"matmul", "rmsnorm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy"} <= set(reg.names())
    if "attention" in reg.names():  # the attention backends arrive through their own hook
        assert any(i.impl == "reference" for i in reg.implementations("attention"))


def test_dispatch_functions_use_the_selected_kernel():
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert torch.allclose(K.rmsnorm(x, w, eps=1e-5), K.reference.rmsnorm(x, w, eps=1e-5))
    y, h = K.rmsnorm(x, w, residual=x)
    assert torch.equal(h, 2 * x)
    g, u = torch.randn(2, 5), torch.randn(2, 5)
    assert torch.allclose(K.swiglu(g, u), torch.nn.functional.silu(g) * u, atol=1e-6)
    z, t = torch.randn(4, 11), torch.randint(0, 11, (4,))
    assert torch.allclose(K.cross_entropy(z, t), torch.nn.functional.cross_entropy(z, t), atol=1e-6)
    hid, wt = torch.randn(4, 8), torch.randn(11, 8)
    assert torch.allclose(K.linear_cross_entropy(hid, wt, t), torch.nn.functional.cross_entropy(hid @ wt.T, t), atol=1e-5)
    assert torch.allclose(K.matmul(hid, wt.T), hid @ wt.T)
    cos, sin = K.rope_tables(torch.arange(3), 4, 100.0)
    assert K.rope(torch.randn(1, 3, 2, 6), cos, sin).shape == (1, 3, 2, 6)


def test_configure_applies_a_kernel_config():
    from plyx.specs import KernelConfig

    reg = K.registry()
    try:
        K.configure(KernelConfig(disabled=["reference"]))
        with pytest.raises(KernelUnavailableError, match="no implementation of kernel 'swiglu'"):
            reg.get("swiglu", torch.ones(2))
    finally:
        K.configure(KernelConfig())
    assert reg.get("swiglu", torch.ones(2)) is K.reference.swiglu


def test_cli_list_and_explain(capsys):
    assert cli.main(["kernels", "list"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm\n  triton" in out and "plyx-kernel" in out
    assert cli.main(["kernels", "explain", "rmsnorm", "--device", "cuda", "--dtype", "bfloat16",
                     "--capability", "9.0", "--shape", "hidden=4096"]) == 0
    out = capsys.readouterr().out
    if HAVE_TRITON:
        assert "TAKEN   triton" in out and "accepted, lower priority (0) than triton" in out
    else:
        assert "refused triton" in out and "module 'triton' is not installed" in out
    assert cli.main(["kernels", "explain", "rmsnorm", "--device", "cuda", "--dtype", "bfloat16",
                     "--capability", "7.5", "--json"]) == 0
    rows = {r["impl"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["reference"]["taken"] and "compute capability (7, 5) below (8, 0)" in rows["triton"]["reason"]
    assert cli.main(["kernels", "explain", "rmsnrom"]) == 2
    assert "not found. It is either misspelled or not installed" in capsys.readouterr().out


PLUGIN = '''
import torch
from plyx.specs import hookimpl
from plyx.specs.kernels import Capability, KernelImpl

plyx_contracts = {"hooks": "1.0", "kernels": "1.0"}

def good(gate, up):
    return (torch.nn.functional.silu(gate.double()) * up.double()).to(gate.dtype)

def bad(x, weight, *, eps=1e-6, residual=None):
    y = x * weight  # no normalisation at all
    return y if residual is None else (y, x + residual)

@hookimpl
def plyx_register_kernels(registry):
    registry.register(KernelImpl("swiglu", "tmpgood", good, Capability(devices={"cpu"}, dtypes={"float32"}), priority=40))
    registry.register(KernelImpl("rmsnorm", "tmpbad", bad, Capability(devices={"cpu"}), priority=40))
'''

SCRIPT = '''
import json, warnings, torch
from plyx.kernel import registry
from plyx.specs.kernels import KernelQuery
reg = registry()
out = {}
out["good_source"] = next(i.source for i in reg.implementations("swiglu") if i.impl == "tmpgood")
out["swiglu_f32"] = reg.select("swiglu", KernelQuery(device_type="cpu", dtype="float32")).impl
out["swiglu_f64"] = reg.select("swiglu", KernelQuery(device_type="cpu", dtype="float64")).impl
out["swiglu_f64_reason"] = [c.reason for c in reg.explain("swiglu", KernelQuery(device_type="cpu", dtype="float64"))
                            if c.impl.impl == "tmpgood"][0]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["rmsnorm"] = reg.select("rmsnorm", KernelQuery(device_type="cpu", dtype="float32")).impl
out["warnings"] = [str(w.message) for w in caught]
print(json.dumps(out))
'''


def _fake_distribution(root, name: str, module: str, source: str) -> None:
    """What pip would leave in site-packages: the module and a dist-info with a `plyx` entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[plyx]\n{module} = {module}\n")


def test_a_kernel_plugin_is_discovered_through_the_entry_point_selected_refused_and_checked(tmp_path):
    _fake_distribution(tmp_path, "tmp-kernels", "tmp_kernels_plugin", PLUGIN)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PLYX_PLUGINS", None)
    env.pop("PLYX_DISABLE_PLUGIN_AUTOLOAD", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["good_source"] == "tmp-kernels 0.3"
    assert out["swiglu_f32"] == "tmpgood"  # its predicates hold: chosen over the reference
    assert out["swiglu_f64"] == "reference"
    assert out["swiglu_f64_reason"] == "refused: dtype float64 not in ['float32']"
    assert out["rmsnorm"] == "reference"  # fails conformance: reported, never used
    assert any("rmsnorm:tmpbad from tmp-kernels 0.3 failed conformance" in w for w in out["warnings"])
    listing = subprocess.run([*PLYX, "kernels", "list"], capture_output=True, text=True, env=env, timeout=300).stdout
    assert "tmpgood" in listing and "tmp-kernels 0.3" in listing


def test_hook_that_raises_is_skipped_with_a_warning_naming_the_distribution(monkeypatch):
    from plyx.kernel._default import populate

    class Broken:
        @staticmethod
        @plugins.hookspecs.hookimpl
        def plyx_register_kernels(registry):
            raise RuntimeError("boom")

    plugins.register_plugin(Broken, "broken-kernels", distribution="broken-dist 9.9")
    monkeypatch.delenv("PLYX_STRICT_PLUGINS", raising=False)  # the nox sessions run strict
    try:
        with pytest.warns(plugins.PluginWarning, match=r"broken-kernels.*broken-dist 9.9.*RuntimeError: boom"):
            reg = populate(K.Registry(verify=False))
        assert "rmsnorm" in reg.names()  # everyone else still registered
        monkeypatch.setenv("PLYX_STRICT_PLUGINS", "1")
        with pytest.raises(plugins.PluginError, match="boom"):
            populate(K.Registry(verify=False))
    finally:
        plugins.unregister_plugin("broken-kernels")
