"""The ``plyx`` command. Its root lives here; planes add subcommands through ``plyx_cli_commands``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from plyx.specs import plugins

__all__ = ["main", "build_parser"]


def _cmd_plugins(args: argparse.Namespace) -> int:
    records = plugins.plugin_report()
    if args.json:
        print(json.dumps([
            {"name": r.name, "distribution": r.distribution, "version": r.version, "value": r.value,
             "status": r.status, "reason": r.reason, "contracts": dict(r.contracts)}
            for r in records
        ], indent=2))
        return 0
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


def build_parser() -> argparse.ArgumentParser:
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

    for name, command in sorted(plugins.cli_commands().items()):
        if name in sub.choices:
            continue  # the root's own commands cannot be replaced
        cp = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(cp)
        cp.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
