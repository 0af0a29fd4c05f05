"""The conformance kit over every implementation the plugin system discovers.

Runs in the `contracts` nox session with every plane and the in-repo plugin
distributions installed: whatever a distribution registers (kernels, KV-cache
kinds, plugins) must pass the same behavioural tests as plyx's own.
On CPU, Triton implementations run through TRITON_INTERPRET=1 on the kit's
first (small) case of each kernel; on a GPU every case runs.
"""

from __future__ import annotations

import os

import pytest
import torch
from plyx.specs.plugins import components, get_plugin_manager, plugin_report
from plyx.specs.testing.kernels import KERNEL_CASES, check_kernel
from plyx.specs.testing.kvcache import check_kvcache
from plyx.specs.testing.plugins import check_plugin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_impls():
    import plyx.kernel

    for impl in plyx.kernel.registry():
        if impl.name in KERNEL_CASES:
            yield pytest.param(impl, id=impl.qualname)


@pytest.mark.parametrize("impl", list(_kernel_impls()))
def test_every_registered_kernel_matches_the_float64_oracle(impl):
    on_device = not impl.capability.devices or DEVICE in impl.capability.devices
    if not on_device and not (INTERPRET and "triton" in impl.capability.requires):
        pytest.skip(f"{impl.qualname} runs on {sorted(impl.capability.devices)} only and is not interpretable here")
    report = check_kernel(
        impl.name, impl.fn, impl=impl.impl, device=DEVICE, dtypes=("float32",),
        grad=impl.capability.backward, quick=not on_device,
    )
    assert report.checked > 0
    assert report.ok, "\n".join(report.failures)


@pytest.mark.parametrize("kind", sorted(components("plyx_kv_cache_kinds")))
def test_every_kv_cache_kind_passes_the_kvcache_kit(kind):
    factory = components("plyx_kv_cache_kinds")[kind].factory
    passed = check_kvcache(factory)
    assert "check_fork_is_copy_on_write" in passed and "check_full_is_recoverable" in passed


def test_every_loaded_plugin_conforms():
    pm = get_plugin_manager()
    loaded = [r.name for r in plugin_report() if r.status == "loaded"]
    assert {"kernel", "attn", "model", "train", "serve"} <= set(loaded)
    for name in loaded:
        check_plugin(pm.get_plugin(name))


@pytest.mark.parametrize("name", sorted(components("plyx_adapter_variants")))
def test_every_adapter_variant_merges_and_unmerges_exactly(name):
    """Whatever a variant computes, folding it into the weight gives the same output, and unfolding restores it."""
    from plyx.model.adapters import LoraConfig, add_adapter, merge_adapter, unmerge_adapter

    torch.manual_seed(0)
    holder = torch.nn.ModuleDict({"proj": torch.nn.Linear(24, 10, dtype=torch.float64)})
    weight = holder["proj"].weight.detach().clone()
    add_adapter(holder, LoraConfig(r=3, target_modules=("proj",), variant=name, init_lora_weights=False))
    x = torch.randn(5, 24, dtype=torch.float64)
    with torch.no_grad():
        adapted = holder["proj"](x)
        assert (adapted - x @ weight.T - holder["proj"].bias).abs().max() > 1e-6  # the adapter does something
        merge_adapter(holder)
        torch.testing.assert_close(holder["proj"](x), adapted)
        unmerge_adapter(holder)
    torch.testing.assert_close(holder["proj"].weight, weight)
