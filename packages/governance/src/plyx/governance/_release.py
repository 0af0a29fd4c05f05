"""What the hooks write, and the release gate that checks it.

Checkpoint (``plyx_on_checkpoint_saved``): ``RECEIPT.json`` and
``LINEAGE.dot`` inside the checkpoint directory (beside a single-file
checkpoint), PNG too when Graphviz is installed; ``RECEIPT.json.dsse.json``
when a signing key is configured (``PLYX_SIGNING_KEY``). The hook's metadata is
a ``plyx.specs.payloads.CheckpointPayload`` or a dict of its fields; its
``techniques`` are recorded in the receipt.

Export (``plyx_on_export_written``) - the release directory gets::

    RECEIPT.json                 inputs (source checkpoint), outputs (artifacts), environment, techniques
    RECEIPT.json.dsse.json       the receipt signed with the release key
    LINEAGE.dot [LINEAGE.png]    data -> tokenizer -> run -> checkpoint -> export
    SBOM.spdx.json SBOM.cdx.json the environment and the artifacts
    MODEL_CARD.md MODEL_CARD.json
    CHECKSUMS.sha256             every file above and every artifact
    CHECKSUMS.sha256.dsse.json   DSSE envelope (in-toto Statement v1), Ed25519
    SIGNING_KEY.pub              the signer's public key

A folder that holds private key material (a PEM/OpenSSH/PKCS#8 private key,
a raw 32-byte Ed25519 seed; see ``_trust.find_private_keys``) is refused before
anything is written: a signing key left in the export directory would be
signed, listed in the SBOM and shipped. The gate fails such a release too.

Signing key: ``key=`` when given, else the file named by ``PLYX_SIGNING_KEY``
(PKCS#8 PEM, mode 0600), else a key generated for this release only and
discarded, recorded as ``ephemeral`` in the signed statement. Set
``PLYX_REQUIRE_SIGNING_KEY=1`` to make a missing key an error instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from plyx.governance._canonical import content_id
from plyx.governance._card import CARD_FILE, CARD_JSON_FILE, write_card
from plyx.governance._errors import GovernanceError
from plyx.governance._files import iter_tree, read_checksums
from plyx.governance._keys import load_private_key
from plyx.governance._lineage import LINEAGE_FILE, write_lineage
from plyx.governance._receipt import (
    RECEIPT_ENVELOPE,
    RECEIPT_FILE,
    load_receipt,
    make_receipt,
    sign_receipt,
    verify_receipt,
    write_receipt,
)
from plyx.governance._report import Report
from plyx.governance._sbom import CYCLONEDX_FILE, SBOM_FILE, validate_spdx, write_sbom
from plyx.governance._sign import CHECKSUMS_FILE, PUBLIC_KEY_FILE, sign_files, verify_signature
from plyx.governance._trust import KeySource, find_private_keys

__all__ = [
    "KEY_ENV",
    "REQUIRE_KEY_ENV",
    "REQUIRED_FILES",
    "signing_key",
    "write_checkpoint_records",
    "write_release",
    "verify_release",
]

KEY_ENV = "PLYX_SIGNING_KEY"
REQUIRE_KEY_ENV = "PLYX_REQUIRE_SIGNING_KEY"
REQUIRED_FILES = (CHECKSUMS_FILE, CHECKSUMS_FILE + ".dsse.json", SBOM_FILE, RECEIPT_FILE, CARD_FILE, CARD_JSON_FILE)
# files the gate and the signer treat as governance output, never as artifacts
_OWN = {RECEIPT_FILE, RECEIPT_ENVELOPE, LINEAGE_FILE, "LINEAGE.png", SBOM_FILE, CYCLONEDX_FILE, CARD_FILE, CARD_JSON_FILE,
        CHECKSUMS_FILE, CHECKSUMS_FILE + ".dsse.json", PUBLIC_KEY_FILE}
_UNSIGNED = {CHECKSUMS_FILE, CHECKSUMS_FILE + ".dsse.json", PUBLIC_KEY_FILE}


def signing_key(key: str | os.PathLike[str] | Ed25519PrivateKey | None = None) -> tuple[Ed25519PrivateKey, bool]:
    """(key, ephemeral): ``key``, else ``$PLYX_SIGNING_KEY``, else a fresh key unless ``$PLYX_REQUIRE_SIGNING_KEY``."""
    if isinstance(key, Ed25519PrivateKey):
        return key, False
    path = key or os.environ.get(KEY_ENV)
    if path:
        return load_private_key(path), False
    if os.environ.get(REQUIRE_KEY_ENV, "") not in ("", "0"):
        raise GovernanceError(KEY_ENV, f"no signing key configured and {REQUIRE_KEY_ENV} is set",
                              fix=f"make one with `plyx governance keygen --out KEY` and set {KEY_ENV}=KEY")
    return Ed25519PrivateKey.generate(), True


def _paths(values: Any, what: str) -> list[Path]:
    if values is None:
        return []
    if isinstance(values, (str, os.PathLike)):
        return [Path(values)]
    if isinstance(values, Mapping):
        return [Path(v) for v in values.values()]
    try:
        return [Path(v) for v in values]
    except TypeError as exc:
        raise GovernanceError(f"metadata.{what}", "expected a path, a list of paths or a name -> path dict",
                              value=values) from exc


def _metadata_dict(metadata: Any) -> dict[str, Any]:
    """Hook metadata as a dict: a ``plyx.specs.payloads`` struct is converted, a mapping copied."""
    from plyx.specs.payloads import payload_dict

    return payload_dict(metadata)


def write_checkpoint_records(path: str | os.PathLike[str], step: int | None, metadata: Any, *,
                             png: bool = True, key: str | os.PathLike[str] | Ed25519PrivateKey | None = None
                             ) -> list[Path]:
    """Write RECEIPT.json and LINEAGE.dot for a saved checkpoint; returns the written paths.

    ``metadata`` (a ``plyx.specs.payloads.CheckpointPayload`` or a dict of its fields):
    ``config``, ``seeds``, ``inputs`` (name -> path), ``outputs`` (paths written; defaults to
    every file of the checkpoint directory), ``metrics``, ``run_id``, ``accelerator``,
    ``techniques``, ``writer``. The receipt is signed (``RECEIPT.json.dsse.json``) with ``key``,
    else ``$PLYX_SIGNING_KEY`` when set; a checkpoint never gets an ephemeral signature.
    """
    path = Path(path)
    if not path.exists():
        raise GovernanceError("path", f"checkpoint {path} does not exist", fix="call the hook after writing it")
    metadata = _metadata_dict(metadata)
    base = path if path.is_dir() else path.parent
    outputs = _paths(metadata.get("outputs"), "outputs")
    if not outputs:
        outputs = list(iter_tree(path, exclude=_OWN)) if path.is_dir() else [path]
    inputs = {str(k): v for k, v in (metadata.get("inputs") or {}).items()}
    extra = {"writer": str(metadata["writer"])} if metadata.get("writer") else None
    receipt = make_receipt(base=base, kind="checkpoint", outputs=outputs, inputs=inputs,
                           config=metadata.get("config"), seeds=metadata.get("seeds"),
                           metrics=metadata.get("metrics"), run_id=metadata.get("run_id") or None, step=step,
                           accelerator=metadata.get("accelerator") or None, techniques=metadata.get("techniques"),
                           extra=extra)
    written = [write_receipt(base / RECEIPT_FILE, receipt)]
    private = key if isinstance(key, Ed25519PrivateKey) else load_private_key(key) if key else (
        load_private_key(os.environ[KEY_ENV]) if os.environ.get(KEY_ENV) else None)
    if private is not None:
        written.append(sign_receipt(base / RECEIPT_FILE, private))
    written += write_lineage(base / LINEAGE_FILE, [receipt], png=png)
    return written


def write_release(path: str | os.PathLike[str], *, name: str | None = None, format: str | None = None,
                  artifacts: Sequence[str | os.PathLike[str]] | None = None,
                  source: str | os.PathLike[str] | None = None, metadata: Mapping[str, Any] | None = None,
                  key: str | os.PathLike[str] | Ed25519PrivateKey | None = None, png: bool = True) -> list[Path]:
    """Write the receipt, lineage, SBOMs, model card, checksums and signature of an export directory.

    Args:
        path: the export directory.
        name: release name (defaults to ``metadata['name']``, then the directory name).
        format: export format (``onnx``, ``hf``, ``safetensors``...).
        artifacts: the exported files (default: every non-governance file in ``path``).
        source: the checkpoint it was exported from; its RECEIPT.json, when present,
            becomes the parent in the lineage.
        metadata: hook metadata (``config``, ``name``...) plus model card fields.
        key: signing key (see the module docstring for the fallbacks).
        png: render LINEAGE.png when Graphviz is installed.
    """
    path = Path(path)
    if not path.is_dir():
        raise GovernanceError("path", f"export directory {path} does not exist or is not a directory",
                              fix="call the hook after writing the export")
    meta = _metadata_dict(metadata)
    meta = {**dict(meta.pop("card", None) or {}), **meta}  # an ExportPayload keeps card fields apart
    name = name or meta.get("name") or path.name
    files = [Path(a) for a in artifacts] if artifacts is not None else []
    if not files:
        files = [p for p in iter_tree(path, exclude=_OWN)]
    if not files:
        raise GovernanceError("artifacts", f"no artifact files in {path}", fix="write the export before signing it")
    secrets = find_private_keys(iter_tree(path))
    if secrets:
        listed = "; ".join(f"{p.relative_to(path).as_posix()} ({kind})" for p, kind in secrets)
        raise GovernanceError("path", f"refusing to release {path}: it holds private key material: {listed}",
                              fix="move the key out of the release folder (keep signing keys outside what you ship)")
    private, ephemeral = signing_key(key)

    receipts: list[dict[str, Any]] = []
    parents: list[str] = []
    inputs: dict[str, Any] = {}
    if source:
        inputs["source_checkpoint"] = source
        src = Path(source)
        src_receipt = (src if src.is_dir() else src.parent) / RECEIPT_FILE
        if src_receipt.is_file():
            parent = load_receipt(src_receipt)
            receipts.append(parent)
            parents.append(parent["content_id"])
    receipt = make_receipt(base=path, kind="export", outputs=files, inputs=inputs, config=meta.get("config"),
                           metrics=meta.get("metrics") or (receipts[0].get("metrics") if receipts else None),
                           run_id=meta.get("run_id") or (receipts[0].get("run_id") if receipts else None),
                           step=receipts[0].get("step") if receipts else None, format=format, parents=parents,
                           accelerator=meta.get("accelerator"), techniques=meta.get("techniques"))
    receipts.append(receipt)
    written = [write_receipt(path / RECEIPT_FILE, receipt), sign_receipt(path / RECEIPT_FILE, private, ephemeral=ephemeral)]
    written += write_lineage(path / LINEAGE_FILE, receipts, png=png)
    written.append(write_sbom(path / SBOM_FILE, str(name), files=files, version=str(meta.get("version") or ""),
                              cyclonedx=path / CYCLONEDX_FILE))
    written.append(path / CYCLONEDX_FILE)
    card_meta = {**meta, "name": name, "format": format}
    if receipts[:-1]:  # the training facts live in the checkpoint's receipt
        card_receipt = {**receipts[0], "format": format, "content_id": receipt["content_id"]}
    else:
        card_receipt = receipt
    written += list(write_card(path / CARD_FILE, files, receipt=card_receipt, metadata=card_meta,
                               sbom=path / SBOM_FILE))
    to_sign = [p for p in iter_tree(path) if p.name not in _UNSIGNED or p.parent != path]
    written += list(sign_files(to_sign, private, path / CHECKSUMS_FILE, ephemeral=ephemeral,
                               predicate={"release": {"name": str(name), "format": format,
                                                      "receipt": receipt["content_id"]}}))
    written.append(path / PUBLIC_KEY_FILE)
    return written


def verify_release(path: str | os.PathLike[str], *, key: KeySource | Sequence[KeySource] | None = None,
                   trust_file: str | os.PathLike[str] | None = None, integrity_only: bool = False) -> Report:
    """The release gate: every problem with a release directory, each naming its artifact.

    Fails when an expected file is missing, a file is not covered by the
    checksums, a checksum or the signature does not match, the SBOM is not
    valid SPDX (spdx-tools) or disagrees with the files, or the receipt's
    content id or digests disagree with the files, the release holds private
    key material, or no trusted key is given (unless ``integrity_only``).

    Args:
        path: the release directory.
        key: trusted public key(s) (``.pub`` or trust-file paths, or key objects).
        trust_file: a file of trusted PEM public keys; ``$PLYX_TRUSTED_KEYS`` adds more.
        integrity_only: with no trusted key, check against the bundled SIGNING_KEY.pub
            (proves nothing changed after signing, not who signed) instead of failing.
    """
    path = Path(path)
    report = Report(f"release {path}")
    if not path.is_dir():
        report.fail(str(path), "missing", "not a directory")
        return report
    for required in REQUIRED_FILES + (() if key or trust_file else (PUBLIC_KEY_FILE,)):
        if not (path / required).is_file():
            report.fail(required, "missing", "expected in a release directory; write it with "
                        "`plyx governance release` (or the plyx_on_export_written hook)")
    if (path / CHECKSUMS_FILE).is_file():
        verify_signature(path / CHECKSUMS_FILE, key=key, trust_file=trust_file, integrity_only=integrity_only,
                         report=report)
        try:
            listed = set(read_checksums(path / CHECKSUMS_FILE))
        except (GovernanceError, UnicodeDecodeError):
            listed = None  # already reported by verify_signature
        if listed is not None:
            for p in iter_tree(path):
                rel = p.relative_to(path).as_posix()
                if rel not in listed and rel not in _UNSIGNED:
                    report.fail(rel, "coverage", f"not covered by {CHECKSUMS_FILE}: added after signing, or "
                                "left out; remove it or re-sign the release")
            for rel in sorted(listed):
                # a release is self-contained: a signed path must not reach outside it
                if rel.startswith("/") or ".." in rel.split("/"):
                    report.fail(rel, "coverage", f"listed in {CHECKSUMS_FILE} but outside the release directory")
    for dirpath, dirnames, filenames in os.walk(path):
        for entry in sorted(dirnames + filenames):
            link = Path(dirpath) / entry
            if link.is_symlink():
                # links are neither signed nor hashed as themselves; their targets can change freely
                report.fail(link.relative_to(path).as_posix(), "coverage",
                            "symbolic links are not allowed in a release; replace it with the file itself")
    for secret, kind in find_private_keys(iter_tree(path)):
        report.fail(secret.relative_to(path).as_posix(), "secret", f"holds {kind}: a release must not ship private "
                    "keys; rotate the key (it was published) and release again without it")
    if (path / SBOM_FILE).is_file():
        validate_spdx(path / SBOM_FILE, report=report)
    if (path / RECEIPT_FILE).is_file():
        # a release travels without its training inputs: check them only where present
        verify_receipt(path / RECEIPT_FILE, report=report, require_inputs=False, key=key, trust_file=trust_file,
                       integrity_only=integrity_only)
    card_json = path / CARD_JSON_FILE
    if card_json.is_file() and (path / RECEIPT_FILE).is_file():
        try:
            receipt_doc = json.loads((path / RECEIPT_FILE).read_text(encoding="utf-8"))
            receipt_id = receipt_doc.get("content_id")
            if receipt_id != content_id(receipt_doc):
                receipt_id = None  # an edited receipt: its own check blamed RECEIPT.json, the card is not at fault
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, GovernanceError):
            receipt_id = None  # the receipt check above already blamed RECEIPT.json
        try:
            card = json.loads(card_json.read_text(encoding="utf-8"))
            if not isinstance(card, dict):
                raise TypeError(f"expected a JSON object, got {type(card).__name__}")
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
            report.fail(CARD_JSON_FILE, "card", f"unreadable: {exc}")
        else:
            if receipt_id is None:
                pass
            elif card.get("receipt") != receipt_id:
                report.fail(CARD_JSON_FILE, "card", f"names receipt {card.get('receipt')}, but {RECEIPT_FILE} "
                            f"is {receipt_id}")
            else:
                report.passed.append(f"{CARD_JSON_FILE}: refers to the receipt in this release")
    return report
