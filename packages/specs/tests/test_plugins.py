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


def test_two_distributions_with_one_plugin_name_is_an_error_naming_both_in_strict_mode(site, monkeypatch):
    site("toy-one", "1.0", {"toy_clash": GOOD})
    site("toy-two", "2.0", {"toy_clash": GOOD})
    monkeypatch.setenv("PLYX_STRICT_PLUGINS", "1")
    with pytest.raises(PluginConflictError) as info:
        plugins.get_plugin_manager()
    assert "toy-one" in str(info.value) and "toy-two 2.0" in str(info.value)


def test_a_name_conflict_skips_both_and_the_rest_keeps_working(site, only, capsys):
    site("toy-one", "1.0", {"toy_clash": GOOD})
    site("toy-two", "2.0", {"toy_clash": GOOD})
    site("toy-fine", "1.0", {"toy_fine": GOOD.replace('"hello"', '"fine"').replace("toy_greedy", "toy_fine")})
    only("toy_clash", "toy_fine")
    with pytest.warns(plugins.PluginWarning, match=r"'toy_clash' is registered by toy-one 1.0 and by toy-two 2.0"):
        records = plugins.plugin_report()
    clash = [r for r in records if r.name == "toy_clash"]
    assert [r.status for r in clash] == ["skipped", "skipped"]
    assert _record("toy_fine").status == "loaded"
    assert main(["fine"]) == 0  # the CLI keeps working
    assert "hello" in capsys.readouterr().out


def test_a_name_conflict_is_resolved_by_an_allowlisted_distribution_or_ignored_when_autoload_is_off(site, monkeypatch):
    site("toy-one", "1.0", {"toy_clash": GOOD})
    site("toy-two", "2.0", {"toy_clash": GOOD})
    monkeypatch.setenv("PLYX_PLUGINS", "toy-two")
    plugins.reset_plugins()
    records = [(r.distribution, r.status) for r in plugins.plugin_report() if r.name == "toy_clash"]
    assert sorted(records) == [("toy-one", "filtered"), ("toy-two", "loaded")]
    monkeypatch.delenv("PLYX_PLUGINS")
    monkeypatch.setenv("PLYX_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugins.reset_plugins()
    assert {r.status for r in plugins.plugin_report()} == {"disabled"}
    assert main(["plugins"]) == 0


def test_allowlist_names_that_match_nothing_are_warned_about(site, monkeypatch):
    site("toy-good", "1.0", {"toy_good": GOOD})
    monkeypatch.setenv("PLYX_PLUGINS", "toy_good,toy_goood")
    plugins.reset_plugins()
    with pytest.warns(plugins.PluginWarning, match=r"PLYX_PLUGINS names 'toy_goood', which match\(es\) no entry"):
        plugins.get_plugin_manager()
    assert _record("toy_good").status == "loaded"


RAISING_CLI = """
from plyx.specs import hookimpl

@hookimpl
def plyx_cli_commands():
    raise ValueError("cli hook broken on purpose")
"""


def test_a_cli_hook_that_raises_is_skipped_attributed_and_the_cli_keeps_working(site, only, capsys):
    site("toy-good", "1.0", {"toy_good": GOOD})
    root = site("toy-badcli", "3.1", {"toy_badcli": RAISING_CLI})
    only("toy_good", "toy_badcli")
    with pytest.warns(plugins.PluginWarning, match=r"toy_badcli.*toy-badcli 3.1.*plyx_cli_commands raised ValueError") as caught:
        assert main(["hello"]) == 0
    assert "hello" in capsys.readouterr().out
    warning = next(w for w in caught if "toy_badcli" in str(w.message))
    assert warning.filename == str(root / "toy_badcli_toy_badcli.py") and warning.lineno == 6  # the plugin's raise


def test_a_broken_plugins_import_warning_points_at_the_plugin(site, only):
    root = site("toy-broken", "1.0", {"toy_broken": BROKEN})
    only("toy_broken")
    with pytest.warns(plugins.PluginWarning, match="broken on purpose") as caught:
        plugins.get_plugin_manager()
    assert caught[0].filename == str(root / "toy_broken_toy_broken.py") and caught[0].lineno == 2


def test_plyx_plugins_never_crashes_in_strict_mode_it_reports(site, only, monkeypatch, capsys):
    site("toy-good", "1.0", {"toy_good": GOOD})
    site("toy-broken", "1.0", {"toy_broken": BROKEN})
    site("toy-badcli", "1.0", {"toy_badcli": RAISING_CLI})
    only("toy_good", "toy_broken", "toy_badcli")
    monkeypatch.setenv("PLYX_STRICT_PLUGINS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plugins.PluginWarning)
        assert main(["plugins"]) == 1
    out, err = capsys.readouterr()
    assert "toy_good" in out and "loaded" in out and "broken on purpose" in out
    assert "PLYX_STRICT_PLUGINS is set and some plugins were skipped" in err
    plugins.reset_plugins()
    assert main(["hello"]) == 1  # other commands: strict mode fails with one attributed line, no traceback
    assert "plyx: error:" in capsys.readouterr().err


def test_a_command_of_a_plane_that_is_not_installed_names_the_distribution_and_the_install_line(
        site, only, monkeypatch, capsys):
    from plyx.specs import cli

    site("toy-good", "1.0", {"toy_good": GOOD})
    only("toy_good")
    monkeypatch.setitem(cli.PLANE_COMMANDS, "frobnicate", "plyx-frobnicate")
    assert main(["frobnicate", "--fast"]) == 2
    err = capsys.readouterr().err
    assert "`plyx frobnicate` is provided by plyx-frobnicate, which is not installed" in err
    assert "pip install --find-links dist/wheelhouse plyx-frobnicate" in err
    assert "invalid choice" not in err


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
    only("toy_nothing_else")
    with pytest.warns(plugins.PluginWarning, match="PLYX_PLUGINS names 'toy_nothing_else'"), pytest.raises(SystemExit):
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


def test_plyx_serve_without_its_plane_loaded_says_which_distribution_provides_it(site, only, capsys):
    site("toy-good", "1.0", {"toy_good": GOOD})
    only("toy_good")  # plyx-serve is either not installed (a plane's own venv) or not loaded (filtered)
    assert main(["serve", "runs/x/latest"]) == 2
    err = capsys.readouterr().err
    assert "`plyx serve` is provided by plyx-serve" in err and "invalid choice" not in err
    assert ("not installed" in err and "pip install plyx-serve" in err) or "not listed in PLYX_PLUGINS" in err
