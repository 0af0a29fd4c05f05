"""DSSE envelopes over in-toto Statement v1, signed with Ed25519.

DSSE (github.com/secure-systems-lab/dsse, protocol v1.0.0) signs the
pre-authentication encoding of the payload, never the base64 text:

    PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body

where LEN is the decimal byte length. The envelope is
``{"payload": b64(body), "payloadType": type, "signatures": [{"keyid", "sig"}]}``;
verifiers accept standard and URL-safe base64. The payload here is an in-toto
Statement v1 (github.com/in-toto/attestation, spec/v1/statement.md).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from plyx.governance._canonical import canonical_json
from plyx.governance._errors import GovernanceError
from plyx.governance._keys import key_id

__all__ = [
    "INTOTO_PAYLOAD_TYPE",
    "STATEMENT_TYPE",
    "pae",
    "make_statement",
    "sign_envelope",
    "verify_envelope",
    "b64decode_any",
    "parse_statement",
]

INTOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding of ``payload`` under ``payload_type``.

    Example:
        >>> pae("http://example.com/HelloWorld", b"hello world")
        b'DSSEv1 29 http://example.com/HelloWorld 11 hello world'
    """
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(type_bytes), type_bytes, len(payload), payload)


def b64decode_any(text: str, what: str) -> bytes:
    """Decode standard or URL-safe base64 (DSSE verifiers must accept both), strictly."""
    if not isinstance(text, str):
        raise GovernanceError(what, "expected a base64 string", value=text)
    normal = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(normal, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise GovernanceError(what, f"not valid base64: {exc}", fix="re-sign the files") from exc


def make_statement(subjects: Mapping[str, str], predicate_type: str, predicate: Mapping[str, Any]) -> dict[str, Any]:
    """An in-toto Statement v1; ``subjects`` maps each file name to its sha256 hex."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest}} for name, digest in sorted(subjects.items())],
        "predicateType": predicate_type,
        "predicate": dict(predicate),
    }


def sign_envelope(statement: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """A DSSE envelope whose payload is the canonical JSON of ``statement``, signed by ``key``."""
    body = canonical_json(statement)
    sig = key.sign(pae(INTOTO_PAYLOAD_TYPE, body))
    return {
        "payload": base64.b64encode(body).decode("ascii"),
        "payloadType": INTOTO_PAYLOAD_TYPE,
        "signatures": [{"keyid": key_id(key.public_key()), "sig": base64.b64encode(sig).decode("ascii")}],
    }


def verify_envelope(envelope: Any, trusted: Sequence[Ed25519PublicKey], *, threshold: int = 1,
                    payload_types: Sequence[str] = (INTOTO_PAYLOAD_TYPE,)) -> bytes:
    """Verify a DSSE envelope; return the payload bytes or raise ``GovernanceError`` saying why.

    Follows the protocol's (t, n) verification: a signature counts when it
    verifies under one of ``trusted`` keys, each key counted once; the keyid
    is only a hint and is never trusted.
    """
    if not isinstance(envelope, Mapping):
        raise GovernanceError("envelope", "expected a JSON object with payload, payloadType and signatures",
                              value=type(envelope).__name__)
    payload_type = envelope.get("payloadType")
    if not isinstance(payload_type, str):
        raise GovernanceError("envelope.payloadType", "missing or not a string", value=payload_type)
    body = b64decode_any(envelope.get("payload"), "envelope.payload")
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise GovernanceError("envelope.signatures", "expected a non-empty list", value=signatures)
    message = pae(payload_type, body)
    accepted: set[str] = set()
    for i, entry in enumerate(signatures):
        if not isinstance(entry, Mapping):
            raise GovernanceError(f"envelope.signatures[{i}]", "expected an object with `sig`", value=entry)
        sig = b64decode_any(entry.get("sig"), f"envelope.signatures[{i}].sig")
        for public in trusted:
            kid = key_id(public)
            if kid in accepted:
                continue
            try:
                public.verify(sig, message)
            except InvalidSignature:
                continue
            accepted.add(kid)
            break
    if len(accepted) < threshold:
        raise GovernanceError("envelope.signatures",
                              f"{len(accepted)} of {len(signatures)} signature(s) verify under the trusted key(s), "
                              f"{threshold} needed: the signed statement or the signature was changed, "
                              f"or it was signed by another key",
                              fix="check that --key is the signer's public key; re-sign if the files changed on purpose")
    if payload_type not in payload_types:
        raise GovernanceError("envelope.payloadType", "unsupported payload type", value=payload_type,
                              fix=f"expected one of {', '.join(payload_types)}")
    return body


def parse_statement(body: bytes) -> dict[str, Any]:
    """Parse a verified payload as an in-toto Statement v1, checking its shape."""
    try:
        statement = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GovernanceError("envelope.payload", f"not UTF-8 JSON: {exc}") from exc
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        raise GovernanceError("statement._type", f"expected {STATEMENT_TYPE!r}",
                              value=statement.get("_type") if isinstance(statement, dict) else statement)
    subjects = statement.get("subject")
    if not isinstance(subjects, list):
        raise GovernanceError("statement.subject", "expected a list", value=subjects)
    for i, s in enumerate(subjects):
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("digest"), dict)
                and isinstance(s["digest"].get("sha256"), str)):
            raise GovernanceError(f"statement.subject[{i}]", "expected {name, digest: {sha256}}", value=s)
    return statement

