"""The release gate: one byte changed anywhere is caught, named, and fails the exit code."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plyx.governance import load_private_key, sign_files, verify_release, verify_signature
from plyx.governance._files import iter_tree


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def failures(report) -> set[tuple[str, str]]:
    return {(p.artifact, p.check) for p in report.problems}


def resign(release: dict[str, Path]) -> None:
    """What someone holding the key would do after changing a file: re-checksum and re-sign everything."""
    d = release["dir"]
    files = [p for p in iter_tree(d) if p.name not in {"CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json",
                                                         "SIGNING_KEY.pub"}]
    sign_files(files, load_private_key(release["key"]), d / "CHECKSUMS.sha256")


def test_untouched_release_passes(release: dict[str, Path], plyx, capsys: pytest.CaptureFixture[str]) -> None:
    report = verify_release(release["dir"], key=release["pub"])
    assert report.ok, report.lines()
    assert plyx(["governance", "verify", str(release["dir"]), "--key", str(release["pub"])]) == 0
    assert capsys.readouterr().out.strip().endswith(f"PASS - release {release['dir']}")


@pytest.mark.parametrize("offset", [0, None, -1])
def test_one_byte_of_an_artifact(release: dict[str, Path], offset: int | None, plyx,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(release["dir"] / "model.onnx", offset)
    report = verify_release(release["dir"], key=release["pub"])
    assert failures(report) == {("model.onnx", "checksum"), ("model.onnx", "receipt"), ("model.onnx", "sbom")}
    assert plyx(["governance", "verify", str(release["dir"]), "--key", str(release["pub"])]) == 1
    out = capsys.readouterr().out
    assert "FAIL model.onnx [checksum]" in out and "FAIL: 3 problem(s)" in out


@pytest.mark.parametrize("offset", [0, None, -3])
def test_one_byte_of_the_receipt(release: dict[str, Path], offset: int | None) -> None:
    flip_byte(release["dir"] / "RECEIPT.json", offset)
    report = verify_release(release["dir"], key=release["pub"])
    assert ("RECEIPT.json", "checksum") in failures(report)
    # depending on where the byte lands, the receipt's own checks (content id, JSON) fail as well, and its
    # signature no longer covers it; every problem is the receipt's, none is blamed on another file
    assert failures(report) <= {("RECEIPT.json", "checksum"), ("RECEIPT.json", "receipt"),
                                ("RECEIPT.json", "signature")}


def test_edited_receipt_that_was_resigned(release: dict[str, Path]) -> None:
    path = release["dir"] / "RECEIPT.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["outputs"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(doc), encoding="utf-8")
    resign(release)
    report = verify_release(release["dir"], key=release["pub"])
    # checksums and their signature are fine now; the receipt itself still disagrees, twice, and its own
    # signature (RECEIPT.json.dsse.json, which the checksums re-signing does not touch) names it
    assert failures(report) == {("RECEIPT.json", "receipt"), ("model.onnx", "receipt"), ("RECEIPT.json", "signature")}


def test_one_byte_of_the_signature(release: dict[str, Path]) -> None:
    path = release["dir"] / "CHECKSUMS.sha256.dsse.json"
    envelope = json.loads(path.read_text(encoding="utf-8"))
    sig = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
    sig[0] ^= 0x01
    envelope["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    path.write_text(json.dumps(envelope), encoding="utf-8")
    report = verify_release(release["dir"], key=release["pub"])
    assert failures(report) == {("CHECKSUMS.sha256.dsse.json", "signature")}
    assert "0 of 1 signature(s) verify" in report.problems[0].message


def test_one_byte_of_the_envelope_file(release: dict[str, Path]) -> None:
    flip_byte(release["dir"] / "CHECKSUMS.sha256.dsse.json")
    report = verify_release(release["dir"], key=release["pub"])
    assert failures(report) == {("CHECKSUMS.sha256.dsse.json", "signature")}


def test_one_byte_of_the_sbom(release: dict[str, Path]) -> None:
    flip_byte(release["dir"] / "SBOM.spdx.json")
    report = verify_release(release["dir"], key=release["pub"])
    assert ("SBOM.spdx.json", "checksum") in failures(report)
    assert {a for a, _ in failures(report)} == {"SBOM.spdx.json"}


def test_invalid_sbom_that_was_resigned(release: dict[str, Path]) -> None:
    path = release["dir"] / "SBOM.spdx.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["packages"][1]["licenseDeclared"] = "Made-Up-License"
    path.write_text(json.dumps(doc), encoding="utf-8")
    resign(release)
    report = verify_release(release["dir"], key=release["pub"])
    assert failures(report) == {("SBOM.spdx.json", "sbom")}
    assert "Made-Up-License" in report.problems[0].message


def test_checksums_edited_to_match_a_changed_file(release: dict[str, Path]) -> None:
    from plyx.governance._files import digest_file

    d = release["dir"]
    flip_byte(d / "model.onnx")
    text = (d / "CHECKSUMS.sha256").read_text(encoding="utf-8")
    lines = [f"{digest_file(d / 'model.onnx')}  model.onnx" if line.endswith("  model.onnx") else line
             for line in text.splitlines()]
    (d / "CHECKSUMS.sha256").write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = verify_release(d, key=release["pub"])
    assert ("CHECKSUMS.sha256", "signature") in failures(report)
    assert "model.onnx" in next(p.message for p in report.problems if p.artifact == "CHECKSUMS.sha256")


def test_missing_and_extra_files(release: dict[str, Path]) -> None:
    d = release["dir"]
    (d / "MODEL_CARD.md").unlink()
    (d / "backdoor.py").write_text("print('hi')\n", encoding="utf-8")
    report = verify_release(d, key=release["pub"])
    assert failures(report) == {("MODEL_CARD.md", "missing"), ("backdoor.py", "coverage")}


def test_replaced_bundled_key_is_caught_by_a_pinned_key(release: dict[str, Path], tmp_path: Path) -> None:
    """Re-signing with an attacker's key passes the bundled-key check but not the pinned one."""
    from plyx.governance import generate_keypair

    d = release["dir"]
    flip_byte(d / "model.onnx")
    evil, _ = generate_keypair(tmp_path / "evil.key")
    files = [p for p in iter_tree(d) if p.name not in {"CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json",
                                                         "SIGNING_KEY.pub"}]
    sign_files(files, load_private_key(evil), d / "CHECKSUMS.sha256")
    assert ("model.onnx", "receipt") in failures(verify_release(d))
    assert ("CHECKSUMS.sha256.dsse.json", "signature") in failures(verify_release(d, key=release["pub"]))


def test_verify_signature_command(release: dict[str, Path], plyx, capsys: pytest.CaptureFixture[str]) -> None:
    checksums = release["dir"] / "CHECKSUMS.sha256"
    assert verify_signature(checksums, key=release["pub"]).ok
    flip_byte(release["dir"] / "MODEL_CARD.json")
    assert plyx(["governance", "verify-signature", str(checksums), "--key", str(release["pub"]), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False
    assert result["problems"] == [{"artifact": "MODEL_CARD.json", "check": "checksum", "message":
                                   result["problems"][0]["message"]}]


def test_gate_through_the_plyx_command(release: dict[str, Path]) -> None:
    """The installed `plyx` script, as CI runs it."""
    flip_byte(release["dir"] / "model.onnx")
    env = {**os.environ, "PLYX_PLUGINS": "governance"}
    done = subprocess.run([sys.executable, "-c", "import sys; from plyx.specs.cli import main; sys.exit(main())",
                           "governance", "verify", str(release["dir"]), "--key", str(release["pub"])],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert "FAIL model.onnx [checksum]" in done.stdout


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_symlinks_and_paths_outside_are_refused(release: dict[str, Path]) -> None:
    d = release["dir"]
    (d / "weights.onnx").symlink_to(d / "model.onnx")
    outside = d.parent / "outside.txt"
    outside.write_text("x", encoding="utf-8")
    from plyx.governance._files import digest_file

    with open(d / "CHECKSUMS.sha256", "a", encoding="utf-8") as f:
        f.write(f"{digest_file(outside)}  ../outside.txt\n")
    found = failures(verify_release(d, key=release["pub"]))
    assert ("weights.onnx", "coverage") in found and ("../outside.txt", "coverage") in found
