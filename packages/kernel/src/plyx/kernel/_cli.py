"""``plyx kernels list``, ``explain NAME`` and ``check [DIST|MODULE]``: what is registered, what selection does, what conforms."""

from __future__ import annotations

import argparse
import json
from typing import Any

from plyx.specs.components import CliCommand
from plyx.specs.kernels import KernelNotFoundError, KernelQuery

__all__ = ["command"]


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="every kernel name and its implementations, highest priority first")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("explain", help="every candidate of NAME for a device and dtype, taken or refused and why")
    p.add_argument("name", help="kernel name (rmsnorm, rope, ...)")
    p.add_argument("--device", default="cpu", help="device type: cpu, cuda, ... (default cpu)")
    p.add_argument("--dtype", default="float32", help="dtype name: float32, bfloat16, ... (default float32)")
    p.add_argument("--capability", default=None,
                   help="CUDA compute capability as MAJOR.MINOR (default: the local GPU's, else 9.0)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=SIZE",
                   help="a named size the predicates look at (hidden=4096, head_dim=128, vocab=128256); repeatable")
    p.add_argument("--grad", action="store_true", help="a backward pass is needed")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("check", help="run the conformance kit on a plugin's kernels: every case, forward and "
                                     "backward, per dtype and device",
                       description="Check the kernel implementations of an installed distribution (DIST), of an "
                                   "importable module (MODULE, a plugin not installed yet), or, with no target, "
                                   "every registered implementation, against the float64 references.")
    p.add_argument("target", nargs="?", default=None, metavar="DIST|MODULE",
                   help="distribution name (plyx-kernels-example) or module path (my_pkg.plyx_plugin)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--dtype", action="append", default=None,
                   help="dtype to check (repeatable; default float32 and bfloat16, plus float16 on CUDA)")
    p.add_argument("--name", action="append", default=None, help="only this kernel name (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _capability(device: str, value: str | None) -> tuple[tuple[int, int] | None, str]:
    if device != "cuda":
        return None, ""
    if value:
        major, _, minor = value.partition(".")
        return (int(major), int(minor or 0)), ""
    import torch

    if torch.cuda.is_available():
        return tuple(torch.cuda.get_device_capability()), ""  # type: ignore[return-value]
    return (9, 0), " (no local GPU: assuming compute capability 9.0; pass --capability to change)"


def _shape(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise SystemExit(f"plyx kernels explain: --shape {item!r} must look like hidden=4096")
        out[key.strip()] = int(value)
    return out


def _run_check(args: argparse.Namespace) -> int:
    from plyx.kernel._check import check_target

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        checked, what = check_target(args.target, device=device, dtypes=args.dtype, names=args.name)
    except LookupError as exc:
        print(f"error: {exc}")
        return 2
    if args.json:
        print(json.dumps([{"kernel": c.impl.qualname, "source": c.impl.source, "ok": c.ok, "note": c.note,
                           "results": [{"case": r.case, "dtype": r.dtype, "device": r.device,
                                        "direction": r.direction, "status": r.status, "detail": r.detail}
                                       for r in c.results]} for c in checked], indent=2))
        return 0 if all(c.ok for c in checked) else 1
    print(f"plyx kernels check: {what} on {device}")
    for c in checked:
        print(f"{'PASS' if c.ok else 'FAIL'} {c.impl.qualname} ({c.impl.source or '-'})" + (f": {c.note}" if c.note else ""))
        for r in c.results:
            line = f"  {r.status:<4} {r.dtype:<8} {r.device:<4} {r.direction:<8} {r.case}"
            print(line + (f"\n         {r.detail}" if r.detail and r.status != "pass" else ""))
    failed = sum(not c.ok for c in checked)
    print(f"{len(checked) - failed}/{len(checked)} implementation(s) conform")
    return 1 if failed else 0


def _run(args: argparse.Namespace) -> int:
    if args.action == "check":
        return _run_check(args)
    from plyx.kernel._default import registry

    reg = registry()
    if args.action == "list":
        rows = [{"name": i.name, "impl": i.impl, "priority": i.priority, "source": i.source,
                 "description": i.description} for i in reg]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        for name in reg.names():
            print(name)
            for i in reg.implementations(name):
                print(f"  {i.impl:<12} priority {i.priority:>4}  {i.source or '-':<24} {i.description}")
        return 0
    cc, note = _capability(args.device, args.capability)
    query = KernelQuery(device_type=args.device, dtype=args.dtype, compute_capability=cc,
                        shape=_shape(args.shape), requires_grad=args.grad)
    try:
        candidates = reg.explain(args.name, query)
    except KernelNotFoundError as exc:
        print(f"error: {exc}")
        return 2
    if args.json:
        print(json.dumps([{"impl": c.impl.impl, "taken": c.taken, "reason": c.reason, "priority": c.impl.priority,
                           "source": c.impl.source} for c in candidates], indent=2))
        return 0
    print(f"{args.name} for {args.device} {args.dtype}{f' sm{cc[0]}{cc[1]}' if cc else ''}"
          f"{''.join(f' {k}={v}' for k, v in sorted(query.shape.items()))}{' with grad' if args.grad else ''}{note}")
    for c in candidates:
        mark = "TAKEN  " if c.taken else "refused" if c.reason.startswith("refused") else "skipped"
        print(f"  {mark} {c.impl.impl:<12} priority {c.impl.priority:>4}  {c.impl.source or '-'}: {c.reason}")
    if not any(c.taken for c in candidates):
        print("  no implementation accepts this query")
        return 1
    return 0


def command() -> Any:
    return CliCommand(name="kernels", help="list kernel implementations and explain which one is selected",
                      configure=_configure, run=_run)
