"""Scenario 4: the reference third-party kernel plugin (integration/plyx-kernels-example), installed beside
plyx-kernel, is discovered, selected where its predicates hold, refused with the reason where they do
not, checked by the conformance kit, and actually runs inside a plyx-model forward.

Its own tests (integration/plyx-kernels-example/tests) check the plugin in isolation; these check it
from the planes' side: ``plyx plugins``, ``plyx.kernel.registry()`` and a ``TransformerLM`` whose MLP
dispatches ``swiglu`` through the registry.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

example = pytest.importorskip("plyx_kernels_example", reason="install integration/plyx-kernels-example")
PLYX = [sys.executable, "-m", "plyx.specs"]


def _query(dtype: str, hidden: int):
    from plyx.specs.kernels import KernelQuery

    return KernelQuery(device_type="cpu", dtype=dtype, shape={"hidden": hidden})


def test_discovered_by_plyx_plugins_with_its_distribution():
    proc = subprocess.run([*PLYX, "plugins", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    row = rows["kernels-example"]
    assert (row["distribution"], row["version"], row["status"]) == ("plyx-kernels-example", "0.1.0", "loaded")
    assert row["contracts"] == {"hooks": "1.0", "kernels": "1.0"}
    # beside the planes, not instead of them
    assert rows["kernel"]["status"] == "loaded" and rows["kernel"]["distribution"] == "plyx-kernel"


@pytest.mark.parametrize("dtype,hidden,reason", [
    ("float64", 64, "refused: dtype float64 not in ['bfloat16', 'float32']"),
    ("float32", 12, "refused: hidden=12 is not a multiple of 8"),
])
def test_selected_where_its_predicates_hold_and_refused_with_the_reason(dtype, hidden, reason):
    from plyx.kernel import registry

    reg = registry()
    impl = next(i for i in reg.implementations("swiglu") if i.impl == "example")
    assert impl.source == "plyx-kernels-example 0.1.0"
    assert reg.select("swiglu", _query("float32", 64)).impl == "example"
    taken = {c.impl.impl: c for c in reg.explain("swiglu", _query("float32", 64))}
    assert taken["example"].taken and not taken["reference"].taken
    assert reg.select("swiglu", _query(dtype, hidden)).impl == "reference"
    refused = {c.impl.impl: c for c in reg.explain("swiglu", _query(dtype, hidden))}
    assert not refused["example"].taken and refused["example"].reason == reason
    assert refused["reference"].taken


def test_passes_the_conformance_kit():
    from plyx.specs.testing.kernels import assert_kernel_conforms, check_kernel

    assert_kernel_conforms("swiglu", example.swiglu, dtypes=("float32", "bfloat16"))
    # the kit is not a rubber stamp: the plugin's deliberately wrong RMSNorm fails it
    report = check_kernel("rmsnorm", example.rmsnorm_broken)
    assert not report.ok and report.failures


def _calls_of(fn, run):
    """How many times the Python function ``fn`` is entered while ``run()`` runs."""
    code, calls = fn.__code__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(1)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        out = run()
    finally:
        sys.setprofile(previous)
    return len(calls), out


@pytest.mark.parametrize("d_ff,dtype,used", [(128, torch.float32, True), (132, torch.float32, False),
                                             (128, torch.float64, False)])
def test_a_plyx_model_forward_runs_it_where_it_is_selected(d_ff, dtype, used):
    """The model asks the registry for ``swiglu`` at every MLP call: the plugin's function runs in float32
    with a hidden size divisible by 8, and the reference runs otherwise; logits agree with the reference."""
    from plyx.kernel import registry
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=2, d_ff=d_ff, max_seq_len=32,
                         dtype=str(dtype).removeprefix("torch."))
    model = TransformerLM(config).eval()
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        model(ids)  # first selection: the registry may probe a third-party kernel with the kit (more calls)
        calls, got = _calls_of(example.swiglu, lambda: model(ids))
        with registry().override(swiglu="reference"):
            ref_calls, want = _calls_of(example.swiglu, lambda: model(ids))
    assert calls == (config.n_layers if used else 0)
    assert ref_calls == 0
    # the same math in the same dtype: float32 rounding of silu(g) * u in a different op order at most
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
