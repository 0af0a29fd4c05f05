"""Reproducibility receipts: what ran, on what, from which inputs, producing which bytes.

A receipt is a JSON object (schema ``plyx.governance.receipt/1``):

    schema, kind (checkpoint | export | artifacts), created, run_id, step, format,
    system, accelerator, python, packages {name: version}, git {commit, dirty} | null,
    config, seeds, metrics,
    inputs  [{name, path, type: file | dir | absent, sha256, size}],
    outputs [{path, type, sha256, size}],
    parents [content ids of the receipts of its inputs],
    techniques  how it was produced (plyx.specs.payloads.Techniques: the kernel chosen per op with its
                implementation, distribution, version, device and dtype; precision, compile, attention
                backend, parallelism, optimizer, data fingerprint; decoding settings) | null,
    content_id  "sha256:<hex>" over the canonical JSON of all of the above

A receipt may be signed: ``RECEIPT.json.dsse.json`` beside it is a DSSE
envelope (in-toto Statement v1, Ed25519) whose subject is the receipt file and
whose predicate carries its content id (``sign_receipt``). ``verify_receipt``
checks that signature against trusted keys when the envelope is present.

Paths are relative to the receipt's directory (``/`` separators) when they
are at most three levels up, so a run directory can move; paths further away
(a shared data cache) are absolute. A directory's digest is ``digest_tree`` (sha256 over the
canonical listing of its files). Values JSON cannot hold are made
representable first: paths become strings, tuples lists, NaN and infinities
the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, other objects ``repr()``.
``verify_receipt`` replays it: every digest is recomputed and compared.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plyx.governance._canonical import CONTENT_ID_FIELD, content_id
from plyx.governance._clock import utc_now
from plyx.governance._environment import accelerator_info, git_info, installed_distributions, python_info, system_info
from plyx.governance._errors import GovernanceError
from plyx.governance._files import digest_file, digest_tree, portable_relpath, write_text_atomic
from plyx.governance._report import Report

__all__ = ["RECEIPT_FILE", "RECEIPT_ENVELOPE", "RECEIPT_SCHEMA", "RECEIPT_PREDICATE", "make_receipt", "write_receipt",
           "load_receipt", "verify_receipt", "sign_receipt", "techniques_record", "jsonable"]

RECEIPT_FILE = "RECEIPT.json"
RECEIPT_ENVELOPE = RECEIPT_FILE + ".dsse.json"
RECEIPT_SCHEMA = "plyx.governance.receipt/1"
RECEIPT_PREDICATE = "https://plyx.dev/governance/receipt/v1"
# files written beside the outputs: a directory digest never includes them
_RECORDS = [RECEIPT_FILE, RECEIPT_ENVELOPE, "LINEAGE.dot", "LINEAGE.png"]


def techniques_record(techniques: Any) -> dict[str, Any] | None:
    """``techniques`` (a ``plyx.specs.payloads.Techniques`` or a dict of its fields) validated, as JSON.

    Raises:
        GovernanceError: naming the field that does not fit the contract.
    """
    if techniques is None:
        return None
    import msgspec
    from plyx.specs.payloads import Techniques

    try:
        typed = techniques if isinstance(techniques, Techniques) else msgspec.convert(
            dict(techniques), Techniques, strict=False)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise GovernanceError("metadata.techniques", f"does not fit plyx.specs.payloads.Techniques: {exc}",
                              fix="pass a Techniques struct or a dict of its fields") from None
    return jsonable(msgspec.to_builtins(typed))


def jsonable(value: Any) -> Any:
    """``value`` with everything JSON cannot hold made representable (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    item = getattr(value, "item", None)  # numpy / torch scalars, without importing either
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError):
            pass
    return repr(value)


_MAX_CLIMB = 3  # "../../../x": a run tree (run/checkpoints/step-N/ -> run/metrics.csv) stays relative


def stored_path(path: str | os.PathLike[str], base: str | os.PathLike[str]) -> str:
    """How a receipt records ``path``: relative to ``base`` when within three levels up, else absolute.

    Files of the same run tree stay relative, so the tree can move; a shared
    data cache elsewhere on the machine is recorded where it is.
    """
    rel = portable_relpath(path, base)
    if rel.split("/")[:_MAX_CLIMB + 1].count("..") <= _MAX_CLIMB:
        return rel
    return Path(os.path.abspath(path)).as_posix()


def _describe(path: str | os.PathLike[str], base: Path, *, exclude: Sequence[str] = (),
              cache: bool = False) -> dict[str, Any]:
    p = Path(path)
    entry: dict[str, Any] = {"path": stored_path(p, base)}
    if p.is_file():
        entry.update(type="file", sha256=digest_file(p, cache=cache), size=p.stat().st_size)
    elif p.is_dir():
        entry.update(type="dir", sha256=digest_tree(p, exclude=exclude, cache=cache),
                     size=sum(f.stat().st_size for f in p.rglob("*") if f.is_file()))
    else:
        entry.update(type="absent", sha256=None, size=None)
    return entry


def make_receipt(*, base: str | os.PathLike[str], kind: str = "artifacts",
                 outputs: Sequence[str | os.PathLike[str]] = (),
                 inputs: Mapping[str, str | os.PathLike[str]] | None = None,
                 config: Mapping[str, Any] | None = None, seeds: Any = None,
                 metrics: Mapping[str, Any] | None = None, run_id: str | None = None, step: int | None = None,
                 format: str | None = None, parents: Sequence[str] = (),
                 accelerator: Mapping[str, Any] | None = None, git_dir: str | os.PathLike[str] = ".",
                 techniques: Any = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build a receipt (a dict with its ``content_id``).

    Args:
        base: the directory the receipt will be written to; paths are stored relative to it.
        kind: ``checkpoint``, ``export`` or ``artifacts``.
        outputs: files or directories produced.
        inputs: name -> path of what was consumed (data, tokenizer, source checkpoint).
            Names containing ``tokenizer`` are drawn as tokenizers in the lineage.
        config, seeds, metrics, run_id, step, format: recorded as given (made JSON-representable).
        parents: content ids of the receipts of the inputs.
        accelerator: what the caller knows about its devices; probed with nvidia-smi otherwise.
        git_dir: a path inside the work tree whose commit is recorded (the current directory by default).
        techniques: how the artifact was produced (``plyx.specs.payloads.Techniques`` or a dict of its fields).
        extra: more top-level fields (must not clash with the schema's own).
    """
    base = Path(base)
    if not outputs and not inputs:
        raise GovernanceError("--artifacts", "a receipt needs at least one input or output",
                              fix="pass the files the run produced with --artifacts")
    # the receipt and lineage files sit beside the outputs; a directory digest must not include them
    own = _RECORDS
    receipt: dict[str, Any] = {
        "schema": RECEIPT_SCHEMA,
        "kind": kind,
        "created": utc_now(),
        "run_id": run_id,
        "step": step,
        "format": format,
        "system": system_info(),
        "accelerator": jsonable(dict(accelerator)) if accelerator else accelerator_info(),
        "python": python_info(),
        "packages": {d.name: d.version for d in installed_distributions()},
        "git": git_info(git_dir),
        "config": jsonable(dict(config or {})),
        "seeds": jsonable(seeds),
        "metrics": jsonable(dict(metrics or {})),
        # inputs are hashed once per process while unchanged (a corpus at every checkpoint would be slow)
        "inputs": [{"name": str(name), **_describe(path, base, cache=True)}
                   for name, path in sorted((inputs or {}).items())],
        "outputs": [_describe(p, base, exclude=own) for p in outputs],
        "parents": sorted(set(parents)),
        "techniques": techniques_record(techniques),
    }
    for key, value in (extra or {}).items():
        if key in receipt or key == CONTENT_ID_FIELD:
            raise GovernanceError(f"extra.{key}", "clashes with a receipt field", fix="rename it")
        receipt[key] = jsonable(value)
    receipt[CONTENT_ID_FIELD] = content_id(receipt)
    return receipt


def write_receipt(path: str | os.PathLike[str], receipt: Mapping[str, Any]) -> Path:
    """Write a receipt as sorted, indented JSON (the content id does not depend on the layout)."""
    return write_text_atomic(path, json.dumps(receipt, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def load_receipt(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a receipt, checking that it is one."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise GovernanceError(str(path), "receipt not found", fix="write one with `plyx governance receipt`") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GovernanceError(str(path), f"not UTF-8 JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != RECEIPT_SCHEMA:
        raise GovernanceError(f"{path}: $.schema", f"not a receipt (expected {RECEIPT_SCHEMA!r})",
                              value=data.get("schema") if isinstance(data, dict) else type(data).__name__)
    return data


def sign_receipt(path: str | os.PathLike[str], key: Any, *, ephemeral: bool = False) -> Path:
    """Sign a receipt file: write ``RECEIPT.json.dsse.json`` beside it (DSSE, Ed25519).

    Args:
        path: the receipt file.
        key: an Ed25519 private key.
        ephemeral: the key was made for this release only (recorded in the statement).

    Returns:
        the envelope's path.
    """
    from plyx.governance._sign import sign_statement

    path = Path(path)
    receipt = load_receipt(path)
    return sign_statement({path.name: digest_file(path)}, key, path.with_name(path.name + ".dsse.json"),
                          RECEIPT_PREDICATE, {"receipt": {"content_id": receipt.get(CONTENT_ID_FIELD),
                                                          "kind": receipt.get("kind")}}, ephemeral=ephemeral)


def verify_receipt(path: str | os.PathLike[str], *, report: Report | None = None,
                   require_inputs: bool = True, key: Any = None, trust_file: str | os.PathLike[str] | None = None,
                   integrity_only: bool = False) -> Report:
    """Replay a receipt: recompute its content id and every input and output digest.

    Each artifact gets a line: byte-equal, changed, missing, or not checkable
    (recorded as absent). Problems name the artifact.

    Args:
        path: the receipt.
        report: add findings to this report instead of a new one.
        require_inputs: a missing input is a problem; when False (a release
            directory shipped without its training data) it is only a note.
            A present input that differs is always a problem.
        key, trust_file, integrity_only: trusted keys for the receipt's signature
            (``RECEIPT.json.dsse.json``), checked when the envelope is present;
            as for ``verify_signature``.
    """
    path = Path(path)
    report = report if report is not None else Report(f"receipt {path}")
    name = path.name
    try:
        receipt = load_receipt(path)
    except GovernanceError as exc:
        report.fail(name, "receipt", str(exc))
        return report
    recorded = receipt.get(CONTENT_ID_FIELD)
    try:
        actual = content_id(receipt)
    except GovernanceError as exc:
        report.fail(name, "receipt", f"cannot be canonicalized: {exc}")
        actual = None
    if actual is not None and actual != recorded:
        report.fail(name, "receipt", f"content id {actual[:23]}... does not match the recorded {str(recorded)[:23]}...: "
                    "the receipt was edited after it was written")
    elif actual is not None:
        report.passed.append(f"{name}: content id {actual[:23]}... matches")
    envelope = path.with_name(path.name + ".dsse.json")
    if envelope.is_file():
        from plyx.governance._sign import verify_statement

        verify_statement(envelope, {name: digest_file(path)}, RECEIPT_PREDICATE, key=key, trust_file=trust_file,
                         integrity_only=integrity_only, report=report,
                         expect={"receipt": {"content_id": recorded, "kind": receipt.get("kind")}})
    base = path.parent
    exclude = _RECORDS
    for role in ("inputs", "outputs"):
        entries = receipt.get(role)
        if not isinstance(entries, list):
            report.fail(name, "receipt", f"$.{role} is not a list")
            continue
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                report.fail(name, "receipt", f"$.{role}[{i}] has no path")
                continue
            rel = entry["path"]
            target = base / rel
            kind, want = entry.get("type"), entry.get("sha256")
            if kind == "absent":
                report.notes.append(f"{rel}: {role[:-1]} was absent when the receipt was written; not checkable")
                continue
            if kind == "file" and target.is_file():
                got = digest_file(target)
            elif kind == "dir" and target.is_dir():
                got = digest_tree(target, exclude=exclude if role == "outputs" else ())
            elif role == "inputs" and not require_inputs:
                report.notes.append(f"{rel}: input not present here; not checked")
                continue
            else:
                report.fail(rel, "receipt", f"{role[:-1]} recorded in {name} is missing")
                continue
            if got == want:
                report.passed.append(f"{rel}: byte-equal to the receipt ({role[:-1]})")
            else:
                report.fail(rel, "receipt", f"{role[:-1]} differs from {name}: sha256 {got[:16]}... "
                            f"recorded {str(want)[:16]}...")
    return report
