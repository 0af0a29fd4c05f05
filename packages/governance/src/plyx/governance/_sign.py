"""Sign files (sha256 checksums + a DSSE/in-toto attestation) and verify them.

``sign_files`` writes three files beside each other:

- ``CHECKSUMS.sha256``: ``<sha256>  <path>`` lines (``sha256sum -c`` reads it),
  paths relative to the checksums file's directory;
- ``CHECKSUMS.sha256.dsse.json``: a DSSE envelope over an in-toto Statement v1
  whose subjects are the same files and digests, Ed25519-signed;
- ``SIGNING_KEY.pub``: the signer's public key, so a directory can be checked
  on its own. Trust comes from pinning the key (``--key``, a trust file or
  ``PLYX_TRUSTED_KEYS``; see ``_trust``): the bundled key only proves that
  nothing changed after signing, not who signed, so it is used only when
  integrity alone is asked for (``integrity_only``); otherwise a verification
  without a trusted key fails.

Files are checked against the digests of the *signed* statement; a checksums
line that disagrees with it is blamed on the checksums file, not on the file
it names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from plyx.governance._clock import utc_now
from plyx.governance._dsse import make_statement, parse_statement, sign_envelope, verify_envelope
from plyx.governance._errors import GovernanceError
from plyx.governance._files import (
    digest_file,
    portable_relpath,
    read_checksums,
    render_checksums,
    write_bytes_atomic,
    write_text_atomic,
)
from plyx.governance._keys import key_id, load_public_key, public_key_pem
from plyx.governance._report import Report
from plyx.governance._trust import TRUST_HOWTO, KeySource, trusted_keys

__all__ = [
    "CHECKSUMS_FILE",
    "ENVELOPE_SUFFIX",
    "PUBLIC_KEY_FILE",
    "PREDICATE_TYPE",
    "sign_files",
    "verify_signature",
    "envelope_path",
    "sign_statement",
    "verify_statement",
]

CHECKSUMS_FILE = "CHECKSUMS.sha256"
ENVELOPE_SUFFIX = ".dsse.json"
PUBLIC_KEY_FILE = "SIGNING_KEY.pub"
PREDICATE_TYPE = "https://plyx.dev/governance/release/v1"


def envelope_path(checksums: str | os.PathLike[str]) -> Path:
    """Where the DSSE envelope of a checksums file lives."""
    checksums = Path(checksums)
    return checksums.with_name(checksums.name + ENVELOPE_SUFFIX)


def sign_files(files: Sequence[str | os.PathLike[str]], key: Ed25519PrivateKey, out: str | os.PathLike[str], *,
               ephemeral: bool = False, predicate: Mapping[str, Any] | None = None,
               write_public_key: bool = True) -> tuple[Path, Path]:
    """Checksum and sign ``files``.

    Args:
        files: the files to cover (directories are not allowed: list their files).
        key: the Ed25519 signing key.
        out: the checksums file to write; the envelope goes to ``out + '.dsse.json'``.
        ephemeral: the key was generated for this signature only and is recorded as such.
        predicate: extra fields for the statement's predicate (name, format...).
        write_public_key: also write ``SIGNING_KEY.pub`` beside ``out``.

    Returns:
        (checksums path, envelope path).
    """
    out = Path(out)
    base = out.parent
    subjects: dict[str, str] = {}
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise GovernanceError("--files", f"{p} is not a file", fix="pass files, not directories or missing paths")
        rel = portable_relpath(p, base)
        if rel in subjects:
            raise GovernanceError("--files", "file listed twice", value=rel)
        subjects[rel] = digest_file(p)
    if not subjects:
        raise GovernanceError("--files", "nothing to sign", fix="pass at least one file")
    write_text_atomic(out, render_checksums(subjects.items()))
    public = key.public_key()
    body = {
        "checksums": {"name": out.name, "sha256": digest_file(out)},
        "signer": {"keyid": key_id(public), "algorithm": "ed25519", "ephemeral": bool(ephemeral)},
        "created": utc_now(),
        **dict(predicate or {}),
    }
    envelope = sign_envelope(make_statement(subjects, PREDICATE_TYPE, body), key)
    env_path = envelope_path(out)
    write_text_atomic(env_path, json.dumps(envelope, indent=2, sort_keys=True) + "\n")
    if write_public_key:
        write_bytes_atomic(base / PUBLIC_KEY_FILE, public_key_pem(public))
    return out, env_path


def sign_statement(subjects: Mapping[str, str], key: Ed25519PrivateKey, out: str | os.PathLike[str],
                   predicate_type: str, predicate: Mapping[str, Any] | None = None, *,
                   ephemeral: bool = False) -> Path:
    """Write a DSSE envelope over an in-toto statement of ``subjects`` (name -> sha256) to ``out``."""
    public = key.public_key()
    body = {"signer": {"keyid": key_id(public), "algorithm": "ed25519", "ephemeral": bool(ephemeral)},
            "created": utc_now(), **dict(predicate or {})}
    envelope = sign_envelope(make_statement(subjects, predicate_type, body), key)
    return write_text_atomic(out, json.dumps(envelope, indent=2, sort_keys=True) + "\n")


def verify_statement(envelope_file: str | os.PathLike[str], subjects: Mapping[str, str], predicate_type: str, *,
                     key: KeySource | Sequence[KeySource] | None = None,
                     trust_file: str | os.PathLike[str] | None = None, integrity_only: bool = False,
                     expect: Mapping[str, Any] | None = None, report: Report) -> dict[str, Any] | None:
    """Check a DSSE envelope made by ``sign_statement``: trusted signer, subjects and predicate fields.

    Without a trusted key the check fails (``trust``) unless ``integrity_only``, which uses the
    ``SIGNING_KEY.pub`` beside it. Problems are blamed on the envelope file. Returns the statement
    when the signature verified.
    """
    env = Path(envelope_file)
    try:
        trusted = trusted_keys(key, trust_file=trust_file)
        if not trusted:
            if not integrity_only:
                report.fail(env.name, "trust", f"no trusted key to check the signature against: {TRUST_HOWTO}")
                return None
            bundled = env.parent / PUBLIC_KEY_FILE
            if not bundled.is_file():
                raise GovernanceError(PUBLIC_KEY_FILE, "not found beside the envelope and no --key given",
                                      fix="pass the signer's public key with --key KEY.pub")
            trusted = [load_public_key(bundled)]
        try:
            envelope = json.loads(env.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GovernanceError(env.name, f"not UTF-8 JSON: {exc}", fix="sign it again") from exc
        statement = parse_statement(verify_envelope(envelope, trusted))
    except GovernanceError as exc:
        report.fail(env.name, "signature", str(exc))
        return None
    signed = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    problems = []
    if statement.get("predicateType") != predicate_type:
        problems.append(f"predicate type {statement.get('predicateType')!r}, expected {predicate_type!r}")
    if set(signed) != set(subjects):
        problems.append(f"signs {', '.join(sorted(signed)) or 'nothing'}, not {', '.join(sorted(subjects))}")
    else:  # the signature is sound; a file it covers changed: blame that file
        for subject, digest in sorted(subjects.items()):
            if signed[subject] != digest:
                report.fail(subject, "signature", f"sha256 {digest[:16]}... but {env.name} signed "
                            f"{signed[subject][:16]}...: it changed after signing")
    predicate = statement.get("predicate") or {}
    for field_name, want in (expect or {}).items():
        if predicate.get(field_name) != want:
            problems.append(f"signed {field_name} {predicate.get(field_name)!r} differs from {want!r}")
    for problem in problems:
        report.fail(env.name, "signature", problem)
    if not problems and signed == dict(subjects):
        report.passed.append(f"{env.name}: Ed25519 signature valid over {', '.join(sorted(signed))}")
    return statement


def verify_signature(checksums: str | os.PathLike[str], *, key: KeySource | Sequence[KeySource] | None = None,
                     trust_file: str | os.PathLike[str] | None = None, integrity_only: bool = False,
                     report: Report | None = None) -> Report:
    """Check a checksums file, its DSSE envelope and every file they list.

    Args:
        checksums: the ``CHECKSUMS.sha256`` file.
        key: trusted public key(s): ``.pub``/trust-file paths or key objects.
        trust_file: a file of trusted PEM public keys; ``$PLYX_TRUSTED_KEYS`` adds more.
        integrity_only: with no trusted key, check against ``SIGNING_KEY.pub``
            beside the checksums (proves nothing changed after signing, not who
            signed). Without it, no trusted key is a failure.
        report: add findings to this report instead of a new one.

    Returns:
        the report; problems name the file and the failed check.
    """
    checksums = Path(checksums)
    base = checksums.parent
    report = report if report is not None else Report(f"signature of {checksums}")
    name = checksums.name
    env_path = envelope_path(checksums)
    if not checksums.is_file():
        report.fail(name, "missing", "checksums file not found; sign the files with `plyx governance sign`")
        return report
    try:
        listed = read_checksums(checksums)
    except (GovernanceError, UnicodeDecodeError) as exc:
        report.fail(name, "checksum", f"unreadable: {exc}")
        listed = {}

    # 1. the signature over the statement
    statement: dict[str, Any] | None = None
    try:
        trusted = trusted_keys(key, trust_file=trust_file)
        if not trusted:
            bundled = base / PUBLIC_KEY_FILE
            if not integrity_only:
                report.fail(env_path.name, "trust", f"no trusted key to check the signature against: {TRUST_HOWTO}")
            if not bundled.is_file():
                raise GovernanceError(PUBLIC_KEY_FILE, "not found and no --key given",
                                      fix="pass the signer's public key with --key KEY.pub")
            trusted = [load_public_key(bundled)]
            report.notes.append(f"checked against the bundled {PUBLIC_KEY_FILE} (keyid {key_id(trusted[0])[:16]}...): "
                                "this proves nothing changed after signing, not who signed; pin the key with --key")
        if not env_path.is_file():
            raise GovernanceError(env_path.name, "signature envelope not found",
                                  fix="sign the files with `plyx governance sign`")
        try:
            envelope = json.loads(env_path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GovernanceError(env_path.name, f"not UTF-8 JSON: {exc}", fix="re-sign the files") from exc
        statement = parse_statement(verify_envelope(envelope, trusted))
        by = f"keyid {key_id(trusted[0])[:16]}..." if len(trusted) == 1 else f"one of {len(trusted)} trusted keys"
        report.passed.append(f"{env_path.name}: Ed25519 signature valid ({by})")
        signer = statement.get("predicate", {}).get("signer", {})
        if isinstance(signer, dict) and signer.get("ephemeral"):
            report.notes.append(f"{env_path.name}: signed with an ephemeral key generated for this release; set "
                                "PLYX_SIGNING_KEY to a kept key to make signatures attributable")
    except GovernanceError as exc:
        report.fail(env_path.name, "signature", str(exc))

    # 2. the signed subjects must be exactly the checksums file's entries
    expected = listed
    if statement is not None:
        signed = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
        if signed != listed:
            changed = sorted(set(signed.items()) ^ set(listed.items()))
            names = sorted({n for n, _ in changed})
            report.fail(name, "signature", f"entries differ from the signed statement for {', '.join(names)}: "
                        "the checksums file was edited after signing; re-sign if that was intended")
        else:
            report.passed.append(f"{name}: matches the signed statement ({len(listed)} files)")
        expected = signed  # what was signed is the truth: an edited line blames the checksums file alone

    # 3. every signed (else listed) file against its digest
    source = "the signed statement" if statement is not None else name
    for rel, want in sorted(expected.items()):
        path = base / rel
        if not path.is_file():
            report.fail(rel, "missing", f"listed in {source} but not found")
            continue
        got = digest_file(path)
        if got != want:
            report.fail(rel, "checksum", f"sha256 {got[:16]}... but {source} says {want[:16]}...: the file changed "
                        "after signing")
        else:
            report.passed.append(f"{rel}: sha256 matches")
    return report
