"""Key generation and the permission check on private keys."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from plyx.governance import (
    GovernanceError,
    KeyPermissionError,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
)

posix_only = pytest.mark.skipif(os.name != "posix", reason="mode bits are POSIX")


@posix_only
def test_keygen_writes_0600_private_and_public_key(tmp_path: Path) -> None:
    old = os.umask(0)  # even a permissive umask must not loosen the private key
    try:
        private, public = generate_keypair(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public == tmp_path / "k.pub"
    assert key_id(load_private_key(private).public_key()) == key_id(load_public_key(public))
    with pytest.raises(GovernanceError, match="already exists"):
        generate_keypair(tmp_path / "k")


@posix_only
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_loose_private_key_is_refused(tmp_path: Path, mode: int) -> None:
    private, _ = generate_keypair(tmp_path / "k")
    os.chmod(private, mode)
    with pytest.raises(KeyPermissionError) as info:
        load_private_key(private)
    assert info.value.mode == mode
    assert f"chmod 600 {private}" in str(info.value)


@posix_only
def test_cli_sign_refuses_a_loose_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], plyx) -> None:
    assert plyx(["governance", "keygen", "--out", str(tmp_path / "k")]) == 0
    (tmp_path / "f.bin").write_bytes(b"x")
    os.chmod(tmp_path / "k", 0o644)
    code = plyx(["governance", "sign", "--files", str(tmp_path / "f.bin"), "--key", str(tmp_path / "k"),
                      "--out", str(tmp_path / "CHECKSUMS.sha256")])
    assert code == 2
    assert "permissions 0644" in capsys.readouterr().err
    assert not (tmp_path / "CHECKSUMS.sha256").exists()


def test_other_key_types_are_refused(tmp_path: Path) -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path = tmp_path / "ec.key"
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(GovernanceError, match="not an Ed25519 key"):
        load_private_key(path)
    with pytest.raises(GovernanceError, match="keygen"):
        load_private_key(tmp_path / "missing.key")


def test_cli_keygen_sign_verify_signature(tmp_path: Path, plyx, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "keys" / "k"
    key.parent.mkdir()
    assert plyx(["governance", "keygen", "--out", str(key)]) == 0
    out = tmp_path / "dist"
    out.mkdir()
    for name, data in (("a.bin", b"a" * 10), ("b.txt", b"bee")):
        (out / name).write_bytes(data)
    checksums = out / "CHECKSUMS.sha256"
    assert plyx(["governance", "sign", "--files", str(out / "a.bin"), str(out / "b.txt"), "--key", str(key),
                 "--out", str(checksums), "--name", "demo"]) == 0
    assert checksums.read_text(encoding="utf-8").splitlines()[1].endswith("  b.txt")
    assert plyx(["governance", "verify-signature", str(checksums), "--key", str(key) + ".pub"]) == 0
    (out / "b.txt").write_bytes(b"bees")
    capsys.readouterr()
    assert plyx(["governance", "verify-signature", str(checksums), "--key", str(key) + ".pub"]) == 1
    assert "FAIL b.txt [checksum]" in capsys.readouterr().out
