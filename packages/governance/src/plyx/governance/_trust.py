"""Which public keys a verifier trusts, and finding private key material that must never ship.

A signature proves who signed only against a key the verifier already trusts.
The key bundled in a release (``SIGNING_KEY.pub``) is whatever the last signer
put there, so it proves integrity only. Trusted keys come from, in order:

- ``--key KEY.pub`` (repeatable) / ``key=``;
- ``--trust FILE`` / ``trust_file=``: one or more PEM public keys in one file
  (comment lines allowed between them), an ``authorized_keys`` for releases;
- ``PLYX_TRUSTED_KEYS``: trust files or ``.pub`` files, separated by ``os.pathsep``.

With none of them a verification fails, unless integrity only is asked for
explicitly (``--integrity-only``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from plyx.governance._errors import GovernanceError

__all__ = ["TRUST_ENV", "TRUST_HOWTO", "KeySource", "trusted_keys", "load_trust_file", "find_private_keys"]

TRUST_ENV = "PLYX_TRUSTED_KEYS"
TRUST_HOWTO = (f"pin the signer's public key: --key SIGNER.pub, --trust FILE (one or more PEM public keys), or "
               f"{TRUST_ENV}=FILE[{os.pathsep}FILE...]; or pass --integrity-only to check only that nothing "
               "changed after signing (against the bundled key, which says nothing about who signed)")
KeySource = str | os.PathLike[str] | Ed25519PublicKey

_PEM_PUBLIC = re.compile(rb"-----BEGIN PUBLIC KEY-----.+?-----END PUBLIC KEY-----", re.S)


def load_trust_file(path: str | os.PathLike[str]) -> list[Ed25519PublicKey]:
    """Every PEM public key in ``path`` (at least one; each must be Ed25519)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GovernanceError("--trust", f"cannot read trust file {path}: {exc}",
                              fix="give a file of PEM public keys (`plyx governance keygen` writes KEY.pub)") from exc
    keys = []
    for i, block in enumerate(_PEM_PUBLIC.findall(data)):
        try:
            key = serialization.load_pem_public_key(block)
        except ValueError as exc:
            raise GovernanceError("--trust", f"key #{i + 1} of {path} is not a valid PEM public key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise GovernanceError("--trust", f"key #{i + 1} of {path} is a {type(key).__name__}, not Ed25519",
                                  fix="list only Ed25519 release keys")
        keys.append(key)
    if not keys:
        raise GovernanceError("--trust", f"{path} holds no PEM public key",
                              fix="concatenate the signers' KEY.pub files into it")
    return keys


def trusted_keys(keys: KeySource | Sequence[KeySource] | None = None, *,
                 trust_file: str | os.PathLike[str] | None = None, env: bool = True) -> list[Ed25519PublicKey]:
    """The keys a verification trusts: ``keys``, the ``trust_file``'s, then ``$PLYX_TRUSTED_KEYS``'s (when ``env``)."""
    if keys is None:
        given: list[KeySource] = []
    elif isinstance(keys, (str, os.PathLike, Ed25519PublicKey)):
        given = [keys]
    else:
        given = list(keys)
    out: list[Ed25519PublicKey] = []
    for k in given:
        out += [k] if isinstance(k, Ed25519PublicKey) else load_trust_file(k)
    if trust_file is not None:
        out += load_trust_file(trust_file)
    if env:
        for item in os.environ.get(TRUST_ENV, "").split(os.pathsep):
            if item.strip():
                out += load_trust_file(item.strip())
    return out


# -- private key material ------------------------------------------------------------
_PEM_PRIVATE = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
_HEX32 = re.compile(rb"\A\s*[0-9a-fA-F]{64}\s*\Z")
_B64_32 = re.compile(rb"\A\s*[A-Za-z0-9+/_\-]{43}=?\s*\Z")
_KEYISH_NAME = re.compile(r"(?i)(?:key|secret|private|seed|signing|sk|ed25519|id_)")
_SCAN_BYTES = 1 << 20  # PEM blocks are looked for in the first MiB of each file


def _private_key_kind(path: Path) -> str:
    """What private key material ``path`` holds ("" if none)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(_SCAN_BYTES)
    if _PEM_PRIVATE.search(head):
        return "a PEM private key"
    if size <= 16384:
        try:  # PKCS#8 / traditional DER, encrypted or not
            serialization.load_der_private_key(head, password=None)
            return "a DER (PKCS#8) private key"
        except TypeError:
            return "an encrypted DER private key"
        except (ValueError, UnsupportedAlgorithm):
            pass
    # 32 random bytes are almost never all printable; a 32-byte config or text file is not a seed
    if size == 32 and not all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return "32 raw bytes (an Ed25519 private key seed)"
    if _KEYISH_NAME.search(path.name) and (_HEX32.match(head) or _B64_32.match(head)):
        return "an Ed25519 private key seed in hex or base64"
    return ""


def find_private_keys(files: Iterable[str | os.PathLike[str]]) -> list[tuple[Path, str]]:
    """(file, what) for every file holding private key material: PEM blocks (PKCS#8, OpenSSH,
    encrypted), DER PKCS#8, and raw 32-byte Ed25519 seeds (binary, or hex/base64 in a key-named file)."""
    found = []
    for f in files:
        p = Path(f)
        if p.is_file():
            kind = _private_key_kind(p)
            if kind:
                found.append((p, kind))
    return found
