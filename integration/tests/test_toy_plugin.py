"""The toy third-party plugin, pip-installed beside plyx-specs, is discovered and used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plyx.specs import plugins

PLYX = [sys.executable, "-m", "plyx.specs"]



def test_listed_by_plyx_plugins_with_distribution_and_version():
    out = subprocess.run([*PLYX, "plugins", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["toy"]["distribution"] == "plyx-plugin-toy"
    assert rows["toy"]["version"] == "0.1.0"
    assert rows["toy"]["status"] == "loaded"
    assert rows["toy"]["contracts"] == {"hooks": "1.0"}


def test_component_and_command_and_lifecycle_hook():
    plugins.reset_plugins()
    assert "toy_first_token" in plugins.components("plyx_samplers")
    out = subprocess.run([*PLYX, "toy", "--echo", "hello"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "toy says hello"
    import plyx_plugin_toy

    plugins.get_plugin_manager().hook.plyx_on_train_step_end(step=7, metrics={"loss": 1.0})
    assert plyx_plugin_toy.STEPS[-1] == 7


def test_allowlist_can_exclude_it(monkeypatch):
    monkeypatch.setenv("PLYX_PLUGINS", "nothing-else")
    plugins.reset_plugins()
    try:
        # an allowlist name that matches nothing is warned about, and it still filters everything else out
        with pytest.warns(plugins.PluginWarning, match="nothing-else"):
            assert next(r for r in plugins.plugin_report() if r.name == "toy").status == "filtered"
        assert "toy_first_token" not in plugins.components("plyx_samplers")
    finally:
        plugins.reset_plugins()
