"""``plyx governance ...`` and ``python -m plyx.governance ...``: one parser for both.

Exit codes: 0 success, 1 a check failed (each problem is printed on its own
line, naming the artifact), 2 bad usage or an input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plyx.governance._card import write_card
from plyx.governance._errors import GovernanceError
from plyx.governance._keys import generate_keypair, load_private_key
from plyx.governance._lineage import write_lineage
from plyx.governance._receipt import RECEIPT_SCHEMA, load_receipt, make_receipt, verify_receipt, write_receipt
from plyx.governance._release import verify_release, write_release
from plyx.governance._report import Report
from plyx.governance._sbom import validate_spdx, write_sbom
from plyx.governance._sign import sign_files, verify_signature

__all__ = ["configure", "run", "main", "HELP"]

HELP = "SBOMs, signatures, receipts, lineage, model cards and the release gate"


def _load_json(path: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise GovernanceError(what, f"{path} not found") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GovernanceError(what, f"{path} is not UTF-8 JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise GovernanceError(what, f"{path} must hold a JSON object", value=type(data).__name__)
    return data


def _print_report(report: Report, as_json: bool) -> int:
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.lines():
            print(line)
    return 0 if report.ok else 1


def _cmd_sbom(args: argparse.Namespace) -> int:
    out = write_sbom(args.out, args.name, files=args.files, version=args.version, cyclonedx=args.cyclonedx)
    print(f"wrote {out}" + (f" and {args.cyclonedx}" if args.cyclonedx else ""))
    if args.validate:
        return _print_report(validate_spdx(out), False)
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    private, public = generate_keypair(args.out, force=args.force)
    print(f"wrote {private} (private, mode 0600) and {public} (public)")
    return 0


def _cmd_sign(args: argparse.Namespace) -> int:
    key = load_private_key(args.key)
    checksums, envelope = sign_files(args.files, key, args.out, predicate={"name": args.name} if args.name else None)
    print(f"wrote {checksums}, {envelope} and the public key beside them")
    return 0


def _cmd_verify_signature(args: argparse.Namespace) -> int:
    return _print_report(verify_signature(args.checksums, key=args.key, trust_file=args.trust,
                                          integrity_only=args.integrity_only), args.json)


def _cmd_receipt(args: argparse.Namespace) -> int:
    if args.receipt_command == "verify":
        return _print_report(verify_receipt(args.receipt, key=args.key, trust_file=args.trust,
                                            integrity_only=args.integrity_only), args.json)
    if not args.out:
        raise GovernanceError("--out", "missing", fix="pass --out RECEIPT.json (or use `receipt verify RECEIPT.json`)")
    meta = _load_json(args.metadata, "--metadata") if args.metadata else {}
    inputs = dict(meta.get("inputs") or {})
    for item in args.input or ():
        name, sep, value = item.partition("=")
        if not sep:
            raise GovernanceError("--input", "expected NAME=PATH", value=item, fix="e.g. --input data=corpus.txt")
        inputs[name] = value
    out = Path(args.out)
    receipt = make_receipt(base=out.parent, kind=args.kind, outputs=list(args.artifacts or meta.get("outputs") or ()),
                           inputs=inputs, config=meta.get("config"), seeds=meta.get("seeds"),
                           metrics=meta.get("metrics"), run_id=meta.get("run_id"), step=meta.get("step"),
                           format=meta.get("format"), accelerator=meta.get("accelerator"))
    write_receipt(out, receipt)
    print(f"wrote {out} ({receipt['content_id']})")
    return 0


def _cmd_lineage(args: argparse.Namespace) -> int:
    receipts = [load_receipt(p) for p in args.metadata]
    written = write_lineage(args.out, receipts, png=not args.no_png)
    print("wrote " + ", ".join(str(p) for p in written))
    if not args.no_png and len(written) == 1:
        print("note: Graphviz `dot` not found on PATH; LINEAGE.png skipped (install graphviz to render it)")
    return 0


def _cmd_card(args: argparse.Namespace) -> int:
    meta = _load_json(args.metadata, "--metadata") if args.metadata else {}
    receipt = meta if meta.get("schema") == RECEIPT_SCHEMA else None
    extra = _load_json(args.card_metadata, "--card-metadata") if args.card_metadata else {}
    if receipt is None:
        extra = {**meta, **extra}
    if args.name:
        extra["name"] = args.name
    md, sidecar = write_card(args.out, args.artifact, receipt=receipt, metadata=extra, sbom=args.sbom)
    print(f"wrote {md} and {sidecar}")
    return 0


def _cmd_release(args: argparse.Namespace) -> int:
    meta = _load_json(args.metadata, "--metadata") if args.metadata else {}
    written = write_release(args.dir, name=args.name, format=args.format, source=args.source, metadata=meta,
                            key=args.key, png=not args.no_png)
    print(f"wrote {len(written)} files into {args.dir}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    return _print_report(verify_release(args.dir, key=args.key, trust_file=args.trust,
                                        integrity_only=args.integrity_only), args.json)


def _add_trust_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", action="append", default=None,
                   help="trusted public key of the signer (repeatable; a file may hold several PEM keys)")
    p.add_argument("--trust", default=None, help="file of trusted PEM public keys (also: $PLYX_TRUSTED_KEYS, "
                   "files separated by the OS path separator)")
    p.add_argument("--integrity-only", action="store_true",
                   help="without a trusted key, check against the bundled SIGNING_KEY.pub: proves nothing changed "
                   "after signing, not who signed (without this flag, no trusted key is a failure)")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the governance subcommands to ``parser`` (the ``plyx governance`` parser or a standalone one)."""
    # subcommands store `governance_func`, not `func`: the plyx root dispatches on `func` to `run`
    sub = parser.add_subparsers(dest="governance_command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("sbom", help="SPDX 2.3 JSON SBOM of this environment (and CycloneDX with --cyclonedx)")
    p.add_argument("--out", required=True, help="SPDX JSON file to write (SBOM.spdx.json)")
    p.add_argument("--name", required=True, help="name of the release the SBOM describes")
    p.add_argument("--version", default="", help="version of the release")
    p.add_argument("--files", nargs="*", default=[], help="artifact files to list with their checksums "
                   "(inside the --out directory)")
    p.add_argument("--cyclonedx", default=None, help="also write a CycloneDX 1.5 JSON BOM here")
    p.add_argument("--validate", action="store_true", help="validate the result with spdx-tools")
    p.set_defaults(governance_func=_cmd_sbom)

    p = sub.add_parser("keygen", help="make an Ed25519 key pair (private 0600, public KEYFILE.pub)")
    p.add_argument("--out", required=True, help="private key file; the public key goes to OUT.pub")
    p.add_argument("--force", action="store_true", help="replace existing key files")
    p.set_defaults(governance_func=_cmd_keygen)

    p = sub.add_parser("sign", help="sha256 checksums + DSSE/in-toto Ed25519 signature of files")
    p.add_argument("--files", nargs="+", required=True, help="files to sign")
    p.add_argument("--key", required=True, help="Ed25519 private key (PEM, mode 0600)")
    p.add_argument("--out", required=True, help="checksums file (CHECKSUMS.sha256); the envelope goes to OUT.dsse.json")
    p.add_argument("--name", default=None, help="release name recorded in the signed statement")
    p.set_defaults(governance_func=_cmd_sign)

    p = sub.add_parser("verify-signature", help="check a checksums file, its signature and the files")
    p.add_argument("checksums", help="CHECKSUMS.sha256")
    _add_trust_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(governance_func=_cmd_verify_signature)

    p = sub.add_parser("receipt", help="write a reproducibility receipt, or `receipt verify RECEIPT.json` to replay one")
    p.add_argument("--artifacts", nargs="*", default=None, help="files or directories produced")
    p.add_argument("--metadata", default=None, help="JSON with config, seeds, inputs {name: path}, metrics, run_id, step")
    p.add_argument("--input", action="append", help="NAME=PATH of an input (repeatable)")
    p.add_argument("--kind", default="artifacts", choices=["artifacts", "checkpoint", "export"])
    p.add_argument("--out", default=None, help="receipt file to write (RECEIPT.json)")
    rsub = p.add_subparsers(dest="receipt_command", metavar="verify")
    rv = rsub.add_parser("verify", help="recompute every digest and report byte-equality per artifact")
    rv.add_argument("receipt", help="RECEIPT.json")
    _add_trust_options(rv)  # checked when RECEIPT.json.dsse.json is beside it
    rv.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(governance_func=_cmd_receipt, receipt_command=None)

    p = sub.add_parser("lineage", help="lineage graph (DOT; PNG when Graphviz is installed) from receipts")
    p.add_argument("--metadata", nargs="+", required=True, help="receipt files (RECEIPT.json)")
    p.add_argument("--out", required=True, help="DOT file to write (LINEAGE.dot)")
    p.add_argument("--no-png", action="store_true", help="do not render LINEAGE.png even when Graphviz is present")
    p.set_defaults(governance_func=_cmd_lineage)

    p = sub.add_parser("card", help="model card (Mitchell et al. sections, Hugging Face YAML) + JSON sidecar")
    p.add_argument("artifact", help="the model artifact (file or directory)")
    p.add_argument("--metadata", default=None, help="its RECEIPT.json, or a JSON of card fields")
    p.add_argument("--card-metadata", default=None, help="JSON of card fields (intended_use, license, eval_metrics...)")
    p.add_argument("--sbom", default=None, help="the SBOM to reference")
    p.add_argument("--name", default=None, help="model name")
    p.add_argument("--out", required=True, help="Markdown file to write (MODEL_CARD.md); the sidecar is OUT.json")
    p.set_defaults(governance_func=_cmd_card)

    p = sub.add_parser("release", help="write receipt, lineage, SBOMs, card, checksums and signature into an export dir")
    p.add_argument("dir", help="the export directory")
    p.add_argument("--name", default=None, help="release name (default: the directory name)")
    p.add_argument("--format", default=None, help="export format (onnx, hf, safetensors...)")
    p.add_argument("--source", default=None, help="the checkpoint it was exported from")
    p.add_argument("--metadata", default=None, help="JSON of config and card fields")
    p.add_argument("--key", default=None, help="Ed25519 private key (default: $PLYX_SIGNING_KEY, else ephemeral)")
    p.add_argument("--no-png", action="store_true", help="do not render LINEAGE.png")
    p.set_defaults(governance_func=_cmd_release)

    p = sub.add_parser("verify", help="the release gate: fail naming every missing, changed or invalid artifact")
    p.add_argument("dir", help="the release directory")
    _add_trust_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(governance_func=_cmd_verify)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed governance command; input and file errors print one line and return 2."""
    try:
        return int(args.governance_func(args) or 0)
    except (GovernanceError, OSError) as exc:  # OSError covers KeyPermissionError and unreadable paths
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plyx.governance``."""
    parser = argparse.ArgumentParser(prog="python -m plyx.governance", description=HELP)
    configure(parser)
    args = parser.parse_args(argv)
    return run(args)
