"""plyx-rl installs alone: the package imports and its plugin is discovered from its distribution."""

from __future__ import annotations

import importlib

from plyx.specs import plugins


def test_package_imports_under_the_namespace():
    module = importlib.import_module("plyx.rl")
    assert module.__name__ == "plyx.rl"
    # PEP 420: plyx itself is a namespace package with no __init__.py
    assert getattr(importlib.import_module("plyx"), "__file__", None) is None


def test_plugin_is_discovered_from_its_distribution():
    plugins.reset_plugins()
    record = next(r for r in plugins.plugin_report() if r.name == "rl")
    assert record.status == "loaded", record.reason
    assert record.distribution == "plyx-rl"
    assert record.value == "plyx.rl._plugin"
