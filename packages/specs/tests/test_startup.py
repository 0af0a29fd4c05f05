"""Startup stays cheap: plugin entry points and `plyx --help` import no torch, and only the command run is configured."""

from __future__ import annotations

import subprocess
import sys

from plyx.specs import plugins
from plyx.specs.cli import main

try:
    from importlib import metadata
except ImportError:  # pragma: no cover
    import importlib_metadata as metadata  # type: ignore[no-redef]


def _plyx_entry_points() -> list[str]:
    return sorted({ep.value.split(":")[0] for ep in metadata.entry_points(group="plyx")
                   if ep.dist is not None and (ep.dist.metadata["Name"] or "").startswith("plyx-")})


def test_plugin_entry_points_and_the_plyx_command_import_no_torch():
    modules = _plyx_entry_points()
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    assert 'torch' not in sys.modules, f'importing the entry point {m} imported torch'\n"
        "from plyx.specs.cli import main\n"
        "for argv in (['--help'], ['plugins']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    heavy = [n for n in ('torch', 'cryptography', 'fastapi') if n in sys.modules]\n"
        "    assert not heavy, f'plyx {argv[0]} imported {heavy}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


CONFIGURE_RAISES = """
from plyx.specs import CliCommand, hookimpl

def configure(parser):
    raise RuntimeError("configured although not run")

@hookimpl
def plyx_cli_commands():
    return [CliCommand("toyslow", "a command whose configure must not run for --help", configure, lambda a: 0)]
"""


def test_only_the_command_being_run_is_configured(site, only, capsys):
    site("toy-slow", "1.0", {"toy_slow": CONFIGURE_RAISES})
    only("toy_slow")
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "toyslow" in capsys.readouterr().out  # listed, not configured
    assert main(["plugins"]) == 0
    plugins.reset_plugins()
    assert main(["toyslow"]) == 1  # run: configured, and the failure is attributed in one line
    assert "toy-slow 1.0" in capsys.readouterr().err
