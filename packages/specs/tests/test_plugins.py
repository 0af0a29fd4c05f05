"""Discovery through the `plyx` entry-point group: loaded, skipped, conflicting, filtered."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import warnings

import pytest
from plyx.specs import Component, PluginConflictError, plugins
from plyx.specs.cli import main
from plyx.specs.errors import IncompatiblePluginError, PluginError

GOOD = """
from plyx.specs import Component, CliCommand, hookimpl

plyx_contracts = {"hooks": "1.0"}

@hookimpl
def plyx_samplers():
    return [Component("toy_greedy", lambda: "greedy", "picks the argmax")]

@hookimpl
def plyx_cli_commands():
    def configure(p):
        p.add_argument("--times", type=int, default=1)
    def run(args):
        print("hello " * args.times)
        return 0
    return [CliCommand("hello", "say hello", configure, run)]
"""

BROKEN = """
raise RuntimeError("this plugin is broken on purpose")
"""

INCOMPATIBLE = """
from plyx.specs import hookimpl
plyx_contracts = {"hooks": "2.0"}

@hookimpl
def plyx_samplers():
    return []
"""

NEWER_MINOR = """
plyx_contracts = {"kvcache": "1.99"}
"""

UNKNOWN_HOOK = """
from plyx.specs import hookimpl

@hookimpl
def plyx_samplerz():
    return []
"""


def _record(name: str) -> plugins.PluginRecord:
    return next(r for r in plugins.plugin_report() if r.name == name)


def test_good_plugin_is_discovered_with_its_distribution(site, only):
    site("toy-good", "0.3.1", {"toy_good": GOOD})
    only("toy_good")
    record = _record("toy_good")
    assert (record.status, record.distribution, record.version) == ("loaded", "toy-good", "0.3.1")
    assert dict(record.contracts) == {"hooks": "1.0"}
    found = plugins.components("plyx_samplers")
    assert found["toy_greedy"].factory() == "greedy"
    assert found["toy_greedy"].source == "toy-good 0.3.1"


def test_broken_plugin_is_skipped_with_a_warning_naming_its_distribution(site, only):
    site("toy-broken", "1.0", {"toy_broken": BROKEN})
    only("toy_broken")
    with pytest.warns(plugins.PluginWarning, match=r"toy-broken 1.0.*broken on purpose"):
        plugins.get_plugin_manager()
    record = _record("toy_broken")
    assert record.status == "skipped"
    assert "RuntimeError" in record.reason


def test_strict_mode_raises_on_a_broken_plugin(site, only, monkeypatch):
    site("toy-broken", "1.0", {"toy_broken": BROKEN})
    only("toy_broken")
    monkeypatch.setenv("PLYX_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="toy-broken"):
        plugins.get_plugin_manager()


def test_incompatible_contract_major_is_skipped(site, only):
    site("toy-future", "2.0", {"toy_future": INCOMPATIBLE})
    only("toy_future")
    with pytest.warns(plugins.PluginWarning, match=r"toy-future 2.0.*hooks contract 2.0.*provides 1.0"):
        plugins.get_plugin_manager()
    assert _record("toy_future").status == "skipped"
    assert not plugins.components("plyx_samplers")


def test_newer_minor_than_provided_is_incompatible_in_strict_mode(site, only, monkeypatch):
    site("toy-minor", "1.0", {"toy_minor": NEWER_MINOR})
    only("toy_minor")
    monkeypatch.setenv("PLYX_STRICT_PLUGINS", "1")
    with pytest.raises(IncompatiblePluginError, match="upgrade plyx-specs"):
        plugins.get_plugin_manager()


def test_unknown_hook_name_is_refused_at_registration(site, only):
    site("toy-typo", "1.0", {"toy_typo": UNKNOWN_HOOK})
    only("toy_typo")
    with pytest.warns(plugins.PluginWarning, match="plyx_samplerz"):
        plugins.get_plugin_manager()
    assert _record("toy_typo").status == "skipped"


def test_two_distributions_with_one_plugin_name_is_an_error_naming_both(site):
    site("toy-one", "1.0", {"toy_clash": GOOD})
    site("toy-two", "2.0", {"toy_clash": GOOD})
    with pytest.raises(PluginConflictError) as info:
        plugins.get_plugin_manager()
    assert "toy-one" in str(info.value) and "toy-two 2.0" in str(info.value)


def test_duplicate_component_names_across_plugins_name_both(site, only):
    site("toy-a", "1.0", {"toy_a": GOOD})
    site("toy-b", "1.0", {"toy_b": GOOD})
    only("toy_a", "toy_b")
    with pytest.raises(PluginConflictError, match=r"toy_greedy.*toy-a 1.0.*toy-b 1.0|toy_greedy.*toy-b 1.0.*toy-a 1.0"):
        plugins.components("plyx_samplers")


def test_allowlist_filters_and_disable_autoload_loads_nothing(site, only, monkeypatch):
    site("toy-good", "1.0", {"toy_good": GOOD})
    site("toy-other", "1.0", {"toy_other": GOOD.replace("toy_greedy", "toy_other").replace('"hello"', '"hi"')})
    only("toy_other")
    assert _record("toy_good").status == "filtered"
    assert _record("toy_other").status == "loaded"
    monkeypatch.setenv("PLYX_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins.reset_plugins()
    assert {r.status for r in plugins.plugin_report()} == {"disabled"}
    assert not plugins.components("plyx_samplers")


def test_scan_happens_once_and_is_cached(site, only):
    site("toy-good", "1.0", {"toy_good": GOOD})
    only("toy_good")
    first = plugins.get_plugin_manager()
    site("toy-late", "1.0", {"toy_late": GOOD})  # resets; a later install needs a new scan
    assert plugins.get_plugin_manager() is not first
    again = plugins.get_plugin_manager()
    assert plugins.get_plugin_manager() is again


def test_importing_specs_scans_nothing():
    code = "import plyx.specs, plyx.specs.config, plyx.specs.plugins as p; print(p._STATE.pm is None, 'torch' in __import__('sys').modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def _child_report(path: str, queue: multiprocessing.Queue) -> None:
    import os
    import sys

    sys.path.insert(0, path)
    os.environ["PLYX_PLUGINS"] = "toy_good"
    from plyx.specs import plugins as child_plugins

    queue.put([(r.name, r.status) for r in child_plugins.plugin_report()])


def test_spawned_process_registers_again(site):
    root = site("toy-good", "1.0", {"toy_good": GOOD})
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_report, args=(str(root), queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=60)
    assert ("toy_good", "loaded") in result


def test_register_plugin_by_hand_checks_contracts():
    class Future:
        plyx_contracts = {"hooks": "9.0"}

    with pytest.raises(IncompatiblePluginError, match="hooks contract 9.0"):
        plugins.register_plugin(Future(), "future")


def test_register_plugin_twice_conflicts():
    class Mine:
        @staticmethod
        def plyx_samplers():
            return [Component("mine", lambda: 1)]

    plugins.register_plugin(Mine(), "mine-test", distribution="test-dist")
    try:
        with pytest.raises(PluginConflictError, match="test-dist"):
            plugins.register_plugin(Mine(), "mine-test", distribution="other-dist")
    finally:
        plugins.unregister_plugin("mine-test")


def test_cli_plugins_lists_loaded_and_skipped(site, only, capsys):
    site("toy-good", "1.0", {"toy_good": GOOD})
    site("toy-broken", "1.0", {"toy_broken": BROKEN})
    only("toy_good", "toy_broken")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plugins.PluginWarning)
        assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "toy_good" in out and "loaded" in out and "toy-good 1.0" in out
    assert "toy_broken" in out and "skipped" in out and "broken on purpose" in out
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["toy_broken"]["status"] == "skipped"


def test_planes_add_subcommands_through_the_hook(site, only, capsys):
    site("toy-good", "1.0", {"toy_good": GOOD})
    only("toy_good")
    assert main(["hello", "--times", "2"]) == 0
    assert capsys.readouterr().out.strip() == "hello hello"
    only("nothing")
    with pytest.raises(SystemExit):
        main(["hello"])


def test_conformance_kit_for_plugins_accepts_a_good_one_and_names_problems():
    import types

    from plyx.specs.testing.plugins import check_plugin

    good = types.SimpleNamespace(
        plyx_contracts={"hooks": "1.0"},
        plyx_samplers=lambda: [Component("a", lambda: 1)],
        plyx_on_train_step_end=lambda step: None,  # a subset of the spec's parameters is fine
    )
    assert check_plugin(good) == ["plyx_on_train_step_end", "plyx_samplers"]
    bad = types.SimpleNamespace(
        plyx_contracts={"hooks": "3.0"},
        plyx_samplers=lambda: [Component("a", lambda: 1), Component("a", lambda: 2), "junk"],
        plyx_on_train_step_end=lambda step, extra: None,
        plyx_nonsense=lambda: None,
    )
    with pytest.raises(AssertionError) as info:
        check_plugin(bad)
    text = str(info.value)
    for needle in ("hooks contract 3.0", "duplicate names ['a']", "'junk' is not a Component",
                   "parameters ['extra']", "plyx_nonsense: not a plyx hook"):
        assert needle in text, needle
