"""``plyx safety``: check policies, scan corpora, red-team targets, evaluate detectors."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from plyx.specs import CliCommand
from plyx.specs.errors import ConfigError

__all__ = ["COMMAND"]


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="safety_command", metavar="ACTION")

    p = sub.add_parser("check", help="validate a policy file and list its rules")
    p.add_argument("policy", help="policy file (TOML/YAML/JSON) or builtin:NAME")

    sub.add_parser("detectors", help="list installed detectors and red-team probes")

    p = sub.add_parser("scan", help="redact or report PII in a corpus before tokenization")
    p.add_argument("corpus", help="a file or folder of .txt/.md/.jsonl documents")
    p.add_argument("--policy", default="builtin:default", help="policy whose [[documents]] rules apply (default: builtin:default)")
    p.add_argument("--out", default=None, help="write the redacted corpus to this folder (default: report only)")
    p.add_argument("--report", default=None, help="JSONL report of flagged documents (rule ids, labels, counts)")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl files (default: text)")

    p = sub.add_parser("redteam", help="run red-team probes against a target and write a report")
    p.add_argument("--target", required=True,
                   help="http(s)://HOST:PORT/v1 (OpenAI-compatible), package.module:function, test:echo or test:refuse")
    p.add_argument("--model", default="", help="model name sent to an HTTP target")
    p.add_argument("--api-key", default="", help="bearer token for an HTTP target")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request (default: 60)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="most reply tokens per request, lowered to fit the context /v1/models reports (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="another request field for an HTTP target, VALUE parsed as JSON when it is (repeatable)")
    p.add_argument("--context", type=int, default=0,
                   help="the target's context in tokens (default: read from /v1/models when it says)")
    p.add_argument("--max-error-rate", type=float, default=0.05,
                   help="share of attempts that may be errors or empty replies before the run fails (default: 0.05)")
    p.add_argument("--probes", default="", help="comma-separated probe names (default: all installed)")
    p.add_argument("--limit", type=int, default=0, help="at most this many attempts per probe (0: all)")
    p.add_argument("--policy", default="", help="put this policy's rails in front of the target")
    p.add_argument("--workers", type=int, default=4, help="concurrent requests (default: 4)")
    p.add_argument("--out", default="redteam-out", help="folder for redteam.jsonl and redteam.md (default: redteam-out)")

    p = sub.add_parser("eval", help="precision and recall of the detectors on the shipped evaluation set")
    p.add_argument("--detectors", default="", help="comma-separated detector names (default: all evaluated)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--confusion", action="store_true",
                   help="also print the confusion matrix (true entity x detector that fired)")


def _run(args: argparse.Namespace) -> int:
    action = getattr(args, "safety_command", None)
    try:
        if action == "check":
            return _check(args)
        if action == "detectors":
            return _detectors()
        if action == "scan":
            return _scan(args)
        if action == "redteam":
            return _redteam(args)
        if action == "eval":
            return _eval(args)
    except (ConfigError, ValueError, LookupError, FileNotFoundError) as exc:
        print(f"plyx safety {action}: {exc}", file=sys.stderr)
        return 1
    print("usage: plyx safety {check,detectors,scan,redteam,eval} ... (see plyx safety --help)", file=sys.stderr)
    return 2


def _check(args: argparse.Namespace) -> int:
    from plyx.safety._policy import load_policy

    policy = load_policy(args.policy)
    print(f"policy {policy.name!r} (schema v{policy.version}) is valid; on_error = {policy.on_error}")
    for rail, _, rule in policy.rules():
        print(f"  {rail:<9} {rule.id:<28} {rule.detector:<18} {rule.action}")
    return 0


def _detectors() -> int:
    from plyx.safety._detectors import available_detectors
    from plyx.safety._redteam import available_probes

    print("detectors (plyx_guardrails):")
    for name, c in sorted(available_detectors().items()):
        print(f"  {name:<18} {c.description}  [{c.source or 'built-in'}]")
    print("red-team probes (plyx_redteam_probes):")
    for name, c in sorted(available_probes().items()):
        print(f"  {name:<18} {c.description}  [{c.source or 'built-in'}]")
    return 0


def _scan(args: argparse.Namespace) -> int:
    from plyx.safety._scan import scan_corpus

    summary = scan_corpus(args.corpus, policy=args.policy, out_dir=args.out, report_path=args.report,
                          text_field=args.text_field)
    print(json.dumps(summary.as_dict(), indent=2))
    return 0


def _redteam(args: argparse.Namespace) -> int:
    from plyx.safety._guard import Guard
    from plyx.safety._redteam import run_redteam
    from plyx.safety._targets import GuardedTarget, resolve_target

    params: dict[str, Any] = {}
    for item in args.param:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: write KEY=VALUE, e.g. --param top_p=0.9")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    http: dict[str, Any] = {"model": args.model, "api_key": args.api_key, "timeout": args.timeout,
                            "max_tokens": args.max_tokens, "temperature": args.temperature, "params": params,
                            "context": args.context}
    target = resolve_target(args.target, **http) if args.target.startswith("http") else resolve_target(args.target)
    name = args.target
    if args.policy:
        target = GuardedTarget(target, Guard(args.policy))
        name += f" behind policy {args.policy}"
    probes = [p.strip() for p in args.probes.split(",") if p.strip()] or None
    options = {p: {"limit": args.limit} for p in (probes or [])} if args.limit else None
    if args.limit and probes is None:
        from plyx.safety._redteam import available_probes

        options = {p: {"limit": args.limit} for p in available_probes()}
    report = run_redteam(target, probes=probes, probe_options=options, out_dir=args.out, workers=args.workers,
                         target_name=name, max_error_rate=args.max_error_rate)
    print(f"{len(report.results)} attempts: {len(report.judged)} judged, failure rate {report.failure_rate:.1%}, "
          f"{report.error_count} errors, {report.empty_count} empty replies")
    empties = report.empties(lambda r: r.probe)
    for probe, (n, f, e) in report.rates(lambda r: r.probe).items():
        print(f"  {probe:<18} {f}/{n} failed" + (f", {e} errors" if e else "") +
              (f", {empties[probe]} empty" if empties.get(probe) else ""))
    first = next((r.error for r in report.results if r.error), "")
    if first:
        print(f"first error: {first}", file=sys.stderr)
    print(f"wrote {report.log_path} and {report.report_path}")
    if not report.ok:
        print(f"plyx safety redteam: {report.verdict}", file=sys.stderr)
        return 1
    return 0


def _eval(args: argparse.Namespace) -> int:
    from plyx.safety._evaluate import confusion_matrix, evaluate, markdown_confusion, markdown_table

    names = [d.strip() for d in args.detectors.split(",") if d.strip()] or None
    scores = evaluate(names)
    matrix = confusion_matrix(names) if args.confusion else None
    if args.json:
        out: dict[str, Any] = {n: {"precision": s.precision, "recall": s.recall, "obfuscated_recall": s.obfuscated_recall,
                                   "tp": s.tp, "fp": s.fp, "fn": s.fn, "tn": s.tn} for n, s in scores.items()}
        if matrix is not None:
            out = {"scores": out, "confusion": matrix}
        print(json.dumps(out, indent=2))
    else:
        print(markdown_table(scores))
        if matrix is not None:
            print()
            print(markdown_confusion(matrix))
    return 0


COMMAND = CliCommand("safety", "guardrail policies: check, scan a corpus, red-team a model, evaluate detectors",
                     _configure, _run)
