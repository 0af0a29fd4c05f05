"""The ``plyx`` command. Its root lives here; planes add subcommands through ``plyx_cli_commands``.

Startup stays cheap: the root commands (``plugins``, ``contracts``) load no
plane command at all, and of the planes' commands only the one being run is
configured (``CliCommand.configure``), so ``plyx --help`` lists every command
from the hooks' names and help lines without importing any plane's CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from plyx.specs import plugins
from plyx.specs.components import CliCommand
from plyx.specs.errors import PluginError

__all__ = ["main", "build_parser", "PLANE_COMMANDS", "WHEELHOUSE"]

#: root commands, served without loading any plane's command
ROOT_COMMANDS = ("plugins", "contracts")
#: the planes' subcommands and the distribution that provides each, for the hint when it is not installed
PLANE_COMMANDS = {
    "train": "plyx-train",
    "data": "plyx-train",
    "serve": "plyx-serve",
    "kernels": "plyx-kernel",
    "model": "plyx-model",
    "export": "plyx-export",
    "governance": "plyx-governance",
    "safety": "plyx-safety",
}
#: where `python tools/workspace.py wheels` writes the wheelhouse, relative to a plyx checkout
WHEELHOUSE = "dist/wheelhouse"


def _cmd_plugins(args: argparse.Namespace) -> int:
    # never raises, strict mode included: it reports every problem, then fails the exit code in strict mode
    records = plugins.plugin_report(strict=False)
    strict_failure = plugins._truthy("PLYX_STRICT_PLUGINS") and any(r.status == "skipped" for r in records)
    if args.json:
        print(json.dumps([
            {"name": r.name, "distribution": r.distribution, "version": r.version, "value": r.value,
             "status": r.status, "reason": r.reason, "contracts": dict(r.contracts)}
            for r in records
        ], indent=2))
        return 1 if strict_failure else 0
    provided = plugins.contract_versions()
    print("contracts provided: " + ", ".join(f"{k} {v}" for k, v in sorted(provided.items())))
    if not records:
        print("no plugins found in the `plyx` entry-point group")
        return 0
    width = max(len(r.name) for r in records)
    for r in records:
        contracts = ", ".join(f"{k} {v}" for k, v in sorted(r.contracts.items())) or "-"
        line = f"{r.name:<{width}}  {r.status:<8}  {r.distribution} {r.version}  [{contracts}]"
        if r.reason:
            line += f"\n{'':<{width}}  -> {r.reason}"
        print(line)
    if strict_failure:
        print("PLYX_STRICT_PLUGINS is set and some plugins were skipped (see above)", file=sys.stderr)
        return 1
    return 0


def _cmd_contracts(args: argparse.Namespace) -> int:
    from plyx.specs import contracts

    if args.action == "snapshot":
        try:
            written = contracts.write_snapshots(args.dir)
        except contracts.SnapshotRefused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}")
        return 0
    if args.action == "record-additive":
        report = contracts.record_additive(args.dir)
    else:
        report = contracts.check_snapshots(args.dir)
    for line in report.lines:
        print(line)
    code = 0 if report.ok else 1
    if args.conformance and args.action == "check":
        from plyx.specs._gate import run_conformance

        code = max(code, run_conformance(device=args.device))
    return code


def build_parser(command: str | None = None, *, plane_commands: bool = True) -> argparse.ArgumentParser:
    """The ``plyx`` parser.

    Args:
        command: the subcommand about to run: only its ``configure`` is called (None: every command's).
        plane_commands: add the planes' commands (``plyx_cli_commands``); the root commands need none.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        specs_version = version("plyx-specs")
    except PackageNotFoundError:  # running from a source tree
        specs_version = "unknown"
    parser = argparse.ArgumentParser(prog="plyx", description="plyx: an LLM stack as a plugin ecosystem.")
    parser.add_argument("--version", action="version", version=f"plyx-specs {specs_version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list discovered plugins, their versions and contracts, and what was skipped")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("contracts", help="check, record or snapshot the frozen contract surfaces",
                       description="check: compare surfaces and frozen behaviour with the snapshots (read-only); "
                       "record-additive: write additive changes into the current major's snapshots (only when "
                       "nothing breaks); snapshot: write every current major's snapshot (refuses to overwrite a "
                       "frozen major with a breaking change)")
    p.add_argument("action", choices=["check", "record-additive", "snapshot"])
    p.add_argument("--dir", default="contracts", help="snapshot directory (default: ./contracts)")
    p.add_argument("--no-update", action="store_true", help=argparse.SUPPRESS)  # check has been read-only since 1.2
    p.add_argument("--conformance", action="store_true",
                   help="check: also run the conformance kits on every discovered implementation (needs torch)")
    p.add_argument("--device", default="cpu", help="device for --conformance (default cpu)")
    p.set_defaults(func=_cmd_contracts)

    if plane_commands:
        for name, cmd in sorted(plugins.cli_commands().items()):
            if name in sub.choices:
                continue  # the root's own commands cannot be replaced
            cp = sub.add_parser(name, help=cmd.help, description=cmd.help)
            cp.set_defaults(func=cmd.run)
            if command is None or name == command:
                _configure(name, cmd, cp)
    parser.set_defaults(_plyx_choices=tuple(sub.choices))
    return parser


def _configure(name: str, cmd: CliCommand, parser: argparse.ArgumentParser) -> None:
    """Call a plane's ``configure``; a failure names the command and the distribution that provides it."""
    try:
        cmd.configure(parser)
    except Exception as exc:  # a plugin's code may fail in any way
        raise PluginError(f"plyx {name}", _provider(name), f"configuring the command raised {type(exc).__name__}: "
                          f"{exc}") from exc


def _provider(name: str) -> str:
    for plugin_name, item in plugins._collect("plyx_cli_commands"):
        if getattr(item, "name", None) == name:
            return plugins.source_of(plugin_name)
    return "<unknown distribution>"


def _command_word(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` asks for (the first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def missing_command_hint(word: str) -> str | None:
    """What to tell a user who typed ``plyx WORD`` when no installed plugin provides WORD (None: not a plane's)."""
    dist = PLANE_COMMANDS.get(word)
    if dist is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(dist)
    except PackageNotFoundError:
        # the planes are not on a public index: the wheelhouse line comes first
        return (f"plyx: `plyx {word}` is provided by {dist}, which is not installed. Install it from a plyx checkout "
                f"(builds every plane into a wheelhouse, then installs {dist} with exactly its dependencies):\n"
                f"    python tools/workspace.py wheels && pip install --find-links {WHEELHOUSE} {dist}\n"
                f"  or from a package index that carries plyx: pip install {dist}")
    why = next((r.reason for r in plugins.plugin_report(strict=False)
                if r.distribution == dist and r.status != "loaded"), "its plugin did not add the command")
    return (f"plyx: `plyx {word}` is provided by {dist} {installed}, which is installed but not loaded: {why}; "
            f"`plyx plugins` shows every plugin and why it was skipped")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(args_in)
    try:
        # "" configures no plane command: `plyx --help` needs only their names and help lines
        parser = build_parser(word or "", plane_commands=word not in ROOT_COMMANDS)
    except PluginError as exc:  # strict mode, or the chosen command's configure failed
        print(f"plyx: error: {exc}", file=sys.stderr)
        return 1
    if word is not None and word not in parser.get_default("_plyx_choices"):
        hint = missing_command_hint(word)
        if hint is not None:
            print(hint, file=sys.stderr)
            return 2
    args = parser.parse_args(args_in)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
