"""Verification that demands trust, releases that never ship a private key, failures that blame the right file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from plyx.governance import (
    GovernanceError,
    generate_keypair,
    load_private_key,
    load_receipt,
    sign_files,
    verify_release,
    write_checkpoint_records,
    write_lineage,
    write_release,
)
from plyx.governance._files import iter_tree


def failures(report) -> set[tuple[str, str]]:
    return {(p.artifact, p.check) for p in report.problems}


def forge(release: dict[str, Path], tmp_path: Path) -> Path:
    """An attacker's copy: the weights replaced, receipt/SBOM/card rewritten, everything re-signed with their key."""
    evil, _ = generate_keypair(tmp_path / "evil.key")
    d = tmp_path / "forged"
    shutil.copytree(release["dir"], d)
    for p in list(iter_tree(d)):
        if p.name not in ("model.onnx",):
            p.unlink()
    (d / "model.onnx").write_bytes(os.urandom(5000))
    write_release(d, name="toy-llm", format="onnx", key=evil, png=False)
    return d


@pytest.fixture(autouse=True)
def _no_ambient_trust(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PLYX_TRUSTED_KEYS", raising=False)


def test_verify_without_a_trusted_key_fails_and_says_how_to_pin_one(release, tmp_path, plyx, capsys):
    forged = forge(release, tmp_path)
    report = verify_release(forged)
    assert not report.ok and ("CHECKSUMS.sha256.dsse.json", "trust") in failures(report)
    text = "\n".join(report.lines())
    assert "--key" in text and "PLYX_TRUSTED_KEYS" in text and "--trust" in text and "--integrity-only" in text
    assert plyx(["governance", "verify", str(forged)]) == 1
    # the genuine release fails the same way: no key, no trust
    assert plyx(["governance", "verify", str(release["dir"])]) == 1
    assert "no trusted key" in capsys.readouterr().out


def test_integrity_only_is_an_explicit_choice(release, tmp_path, plyx, capsys):
    forged = forge(release, tmp_path)
    assert plyx(["governance", "verify", str(forged), "--integrity-only"]) == 0
    assert "not who signed" in capsys.readouterr().out
    assert verify_release(release["dir"], integrity_only=True).ok


def test_trusted_keys_from_the_environment_and_a_trust_file(release, tmp_path, plyx, monkeypatch):
    forged = forge(release, tmp_path)
    monkeypatch.setenv("PLYX_TRUSTED_KEYS", str(release["pub"]))
    assert verify_release(release["dir"]).ok
    assert ("CHECKSUMS.sha256.dsse.json", "signature") in failures(verify_release(forged))
    monkeypatch.delenv("PLYX_TRUSTED_KEYS")
    # a trust file holds several keys: any one of them may have signed
    _, other_pub = generate_keypair(tmp_path / "other.key")
    trust = tmp_path / "trusted_keys.pem"
    trust.write_bytes(b"# release signers\n" + other_pub.read_bytes() + release["pub"].read_bytes())
    assert plyx(["governance", "verify", str(release["dir"]), "--trust", str(trust)]) == 0
    assert plyx(["governance", "verify", str(forged), "--trust", str(trust)]) == 1
    assert plyx(["governance", "verify-signature", str(release["dir"] / "CHECKSUMS.sha256")]) == 1
    assert plyx(["governance", "verify-signature", str(release["dir"] / "CHECKSUMS.sha256"), "--trust", str(trust)]) == 0


def _pkcs8_der(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.mark.parametrize("kind", ["pem", "der", "raw", "openssh", "encrypted_pem"])
def test_a_release_folder_holding_private_key_material_is_refused(release, tmp_path, kind):
    d = tmp_path / "rel"
    d.mkdir()
    (d / "model.onnx").write_bytes(os.urandom(3000))
    key = Ed25519PrivateKey.generate()
    name, data = {
        "pem": ("release.key", load_private_key(release["key"]).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())),
        "der": ("signer.der", _pkcs8_der(key)),
        "raw": ("seed.bin", key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())),
        "openssh": ("id_ed25519", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                    serialization.NoEncryption())),
        "encrypted_pem": ("notes/backup.pem", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"))),
    }[kind]
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    with pytest.raises(GovernanceError, match="private key") as info:
        write_release(d, name="x", key=release["key"], png=False)
    assert name in str(info.value)
    assert not (d / "CHECKSUMS.sha256").exists() and not (d / "RECEIPT.json").exists()  # nothing half-written


def test_small_text_files_are_not_mistaken_for_keys(release, tmp_path):
    d = tmp_path / "rel"
    d.mkdir()
    (d / "model.onnx").write_bytes(os.urandom(3000))
    (d / "config.json").write_text('{"d_model": 64, "n_layers": 12}\n')  # 32 bytes of text
    assert len((d / "config.json").read_bytes()) == 32
    (d / "sha.txt").write_text("ab" * 32)  # 64 hex characters, in a file not named like a key
    write_release(d, name="x", key=release["key"], png=False)
    assert verify_release(d, key=release["pub"]).ok


def test_verify_fails_a_release_that_ships_a_private_key(release):
    d = release["dir"]
    shutil.copy(release["key"], d / "release.key")
    files = [p for p in iter_tree(d) if p.name not in {"CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json",
                                                         "SIGNING_KEY.pub"}]
    sign_files(files, load_private_key(release["key"]), d / "CHECKSUMS.sha256")  # signed by the real key
    assert ("release.key", "secret") in failures(verify_release(d, key=release["pub"]))


def test_a_changed_checksums_line_blames_the_checksums_file_only(release):
    d = release["dir"]
    lines = (d / "CHECKSUMS.sha256").read_text().splitlines()
    for target in ("model.onnx", "LINEAGE.dot"):
        i = next(i for i, line in enumerate(lines) if line.endswith("  " + target))
        edited = lines.copy()
        edited[i] = "0" * 64 + "  " + target
        (d / "CHECKSUMS.sha256").write_text("\n".join(edited) + "\n")
        found = failures(verify_release(d, key=release["pub"]))
        assert {a for a, _ in found} == {"CHECKSUMS.sha256"}, found


def test_a_broken_receipt_is_blamed_on_the_receipt(release):
    d = release["dir"]
    (d / "RECEIPT.json").write_text("{broken", encoding="utf-8")
    found = failures(verify_release(d, key=release["pub"]))
    assert {a for a, _ in found} == {"RECEIPT.json"}, found


def test_lineage_never_says_step_none(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"x" * 100)
    write_checkpoint_records(ckpt, None, {"run_id": "r"}, png=False)
    dot = (ckpt / "LINEAGE.dot").read_text()
    assert "None" not in dot and "checkpoint" in dot
    written = write_lineage(tmp_path / "L.dot", [load_receipt(ckpt / "RECEIPT.json")], png=False)
    assert "None" not in written[0].read_text()
