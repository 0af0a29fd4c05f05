"""plyx-kernels-example installed beside plyx-kernel: discovered, selected, refused with a reason, checked.

Run in an environment where this distribution is installed (the integration session):
``pip install ./packages/specs ./packages/kernel ./integration/plyx-kernels-example[test]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from plyx.kernel import Registry, registry, reset_registry
from plyx.kernel._default import populate
from plyx.specs.kernels import KernelQuery
from plyx.specs.testing.kernels import assert_kernel_conforms, check_kernel

PLYX = [sys.executable, "-m", "plyx.specs"]


def _query(dtype: str = "float32", hidden: int = 64) -> KernelQuery:
    return KernelQuery(device_type="cpu", dtype=dtype, shape={"hidden": hidden})


def test_discovered_through_the_entry_point_with_its_distribution():
    out = subprocess.run([*PLYX, "plugins", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["kernels-example"]["distribution"] == "plyx-kernels-example"
    assert rows["kernels-example"]["status"] == "loaded"
    assert rows["kernels-example"]["contracts"] == {"hooks": "1.0", "kernels": "1.0"}
    impl = next(i for i in registry().implementations("swiglu") if i.impl == "example")
    assert impl.source == "plyx-kernels-example 0.1.0"
    listing = subprocess.run([*PLYX, "kernels", "list"], capture_output=True, text=True, check=True).stdout
    assert "example" in listing and "plyx-kernels-example 0.1.0" in listing


def test_selected_where_its_predicates_hold():
    import plyx_kernels_example

    reg = registry()
    assert reg.select("swiglu", _query("float32", 64)).impl == "example"
    g, u = torch.randn(3, 64), torch.randn(3, 64)
    assert reg.get("swiglu", g, u) is plyx_kernels_example.swiglu
    assert torch.allclose(reg("swiglu", g, u), torch.nn.functional.silu(g) * u, atol=1e-6)


@pytest.mark.parametrize("query,reason", [
    (_query("float64", 64), "refused: dtype float64 not in ['bfloat16', 'float32']"),
    (_query("float32", 12), "refused: hidden=12 is not a multiple of 8"),
])
def test_refused_with_the_reason_where_they_do_not(query, reason):
    reg = registry()
    assert reg.select("swiglu", query).impl == "reference"
    assert {c.impl.impl: c.reason for c in reg.explain("swiglu", query)}["example"] == reason
    out = subprocess.run([*PLYX, "kernels", "explain", "swiglu", "--dtype", query.dtype, "--shape",
                          f"hidden={query.shape['hidden']}"], capture_output=True, text=True, check=True).stdout
    assert reason in out


def test_passes_the_conformance_kit():
    import plyx_kernels_example

    assert_kernel_conforms("swiglu", plyx_kernels_example.swiglu, dtypes=("float32", "bfloat16"))


def test_a_kernel_failing_conformance_is_reported_and_not_used():
    import plyx_kernels_example

    report = check_kernel("rmsnorm", plyx_kernels_example.rmsnorm_broken)
    assert not report.ok and "output 0 off by" in report.failures[0]
    script = ("import json, warnings, torch\n"
              "from plyx.kernel import registry\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    fn = registry().get('rmsnorm', torch.ones(2, 8))\n"
              "print(json.dumps({'fn': fn.__module__, 'warnings': [str(x.message) for x in w]}))\n")
    env = {**os.environ, "PLYX_KERNELS_EXAMPLE_BROKEN": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fn"] != "plyx_kernels_example"
    assert any("rmsnorm:example-broken from plyx-kernels-example 0.1.0 failed conformance" in w for w in out["warnings"])


def test_registered_in_a_private_registry_too():
    reg = populate(Registry())
    assert "example" in {i.impl for i in reg.implementations("swiglu")}
    reset_registry()
