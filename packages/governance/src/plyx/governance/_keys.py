"""Ed25519 signing keys: generation, loading with a permission check, key ids.

Private keys are unencrypted PKCS#8 PEM files readable by their owner only
(0600); a looser file is refused, the way ssh refuses a loose identity file.
Public keys are SubjectPublicKeyInfo PEM. A key id is the sha256 hex of the
32 raw public-key bytes.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from plyx.governance._errors import GovernanceError, KeyPermissionError
from plyx.governance._files import write_bytes_atomic

__all__ = [
    "generate_keypair",
    "key_id",
    "load_private_key",
    "load_public_key",
    "public_key_pem",
    "check_key_permissions",
]


def key_id(public_key: Ed25519PublicKey) -> str:
    """sha256 hex of the raw public key: the DSSE ``keyid`` hint."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    """SubjectPublicKeyInfo PEM of a public key."""
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_keypair(out: str | os.PathLike[str], *, force: bool = False) -> tuple[Path, Path]:
    """Write a new Ed25519 private key to ``out`` (mode 0600) and its public key to ``out + '.pub'``.

    Args:
        out: private key path.
        force: replace existing files instead of refusing.

    Returns:
        (private key path, public key path).

    Example:
        >>> priv, pub = generate_keypair(tmp_path / "release.key")  # doctest: +SKIP
    """
    out = Path(out)
    pub = out.with_name(out.name + ".pub")
    for p in (out, pub):
        if p.exists() and not force:
            raise GovernanceError("--out", f"{p} already exists", fix="pick another path or pass --force to replace it")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_bytes_atomic(out, pem, mode=0o600)
    write_bytes_atomic(pub, public_key_pem(key.public_key()))
    return out, pub


def check_key_permissions(path: str | os.PathLike[str]) -> None:
    """Raise ``KeyPermissionError`` when group or others have any access to a private key file."""
    if os.name != "posix":  # Windows ACLs are not mode bits; nothing meaningful to check
        return
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise KeyPermissionError(str(path), mode)


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an Ed25519 private key, refusing a file that others can read."""
    path = Path(path)
    if not path.is_file():
        raise GovernanceError("--key", f"no private key file at {path}",
                              fix="make one with `plyx governance keygen --out KEYFILE`")
    check_key_permissions(path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise GovernanceError("--key", f"{path} is not an unencrypted PEM private key: {exc}",
                              fix="make one with `plyx governance keygen --out KEYFILE`") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise GovernanceError("--key", f"{path} holds a {type(key).__name__}, not an Ed25519 key",
                              fix="make one with `plyx governance keygen --out KEYFILE`")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Load an Ed25519 public key (PEM, as written by ``generate_keypair``)."""
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError as exc:
        raise GovernanceError("--key", f"no public key file at {path}",
                              fix="pass the `.pub` file written by `plyx governance keygen`") from exc
    except ValueError as exc:
        raise GovernanceError("--key", f"{path} is not a PEM public key: {exc}",
                              fix="pass the `.pub` file written by `plyx governance keygen`") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise GovernanceError("--key", f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key
