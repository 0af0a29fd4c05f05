"""Scenario 2: train -> export -> governance verify.

The checkpoint of the session's training run is exported with the real command line
(``plyx export CKPT --format onnx --out DIR``, verified in onnxruntime by plyx-export),
plyx-governance's ``plyx_on_export_written`` hook turns the directory into a signed
release, and ``plyx governance verify DIR`` passes on it. One flipped byte of
``model.onnx`` then fails the gate with the file named. The graph's logits are also
checked here, in onnxruntime, against the torch model loaded from the same checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PLYX = [sys.executable, "-m", "plyx.specs"]


def _plyx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLYX, *args], capture_output=True, text=True, timeout=420,
                          env={**os.environ, **(env or {})})


def _export(checkpoint: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _plyx("export", str(checkpoint), "--format", "onnx", "--out", str(out), "--name", "tiny-llm", "--json",
                 env=env)


@pytest.fixture(scope="module")
def export_run(trained, tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``plyx export CKPT --format onnx --out DIR`` as a user runs it, with every plugin installed
    (the example kernel plugin included: an override to the reference kernels must never run a
    plugin's conformance probe inside the export trace)."""
    from plyx.governance import generate_keypair

    root = tmp_path_factory.mktemp("export")
    out = root / "tiny-onnx"
    # the release is signed with a kept key (outside the release folder), and verified against it pinned
    generate_keypair(root / "keys" / "release.key")
    return _export(trained.checkpoint, out, env={"PLYX_SIGNING_KEY": str(root / "keys" / "release.key")}), out


def _pub(exported: Path) -> str:
    return str(exported.parent / "keys" / "release.key.pub")


@pytest.fixture(scope="module")
def exported(export_run) -> Path:
    proc, path = export_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_plyx_export_command(export_run):
    proc, path = export_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["format"] == "onnx" and Path(result["path"]) == path.resolve()
    verification = result["verification"]  # plyx-export's own onnxruntime check, on by default
    assert verification["ok"] and len(verification["checks"]) == 2
    assert all(c["passed"] for c in verification["checks"])


def test_export_wrote_the_graph_and_the_governance_release(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"model.onnx", "plyx_export.json", "tokenizer.json"} <= names
    # written by plyx-governance's hook, not by plyx-export
    assert {"RECEIPT.json", "SBOM.spdx.json", "CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json",
            "SIGNING_KEY.pub", "MODEL_CARD.md"} <= names
    checksums = (exported / "CHECKSUMS.sha256").read_text()
    assert " model.onnx" in checksums or "*model.onnx" in checksums


def test_onnx_logits_match_the_trained_torch_model(trained, exported):
    import onnxruntime as ort
    from plyx.export import reference_kernels
    from plyx.model import load_checkpoint

    model = load_checkpoint(trained.checkpoint).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), reference_kernels():
        want = model(ids).float().numpy()  # (2, 9, V)
    session = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"input_ids": ids.numpy().astype(np.int64)})[0]
    assert got.shape == want.shape
    # float32 graph vs float32 eager: differences are accumulation order only
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_governance_verify_passes_then_names_a_flipped_byte(exported, tmp_path):
    ok = _plyx("governance", "verify", str(exported), "--key", _pub(exported))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("PASS")

    release = Path(shutil.copytree(exported, tmp_path / "tampered"))
    graph = release / "model.onnx"
    raw = bytearray(graph.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte in the middle of the weights
    graph.write_bytes(bytes(raw))
    bad = _plyx("governance", "verify", str(release), "--key", _pub(exported))
    assert bad.returncode != 0, bad.stdout
    fails = [line for line in bad.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails and all("model.onnx" in line for line in fails), bad.stdout
    assert {"checksum", "receipt", "sbom"} <= {line.split("[", 1)[1].split("]", 1)[0] for line in fails}

    # the same gate from Python gives the same verdict (and leaves the untouched release passing)
    from plyx.governance import verify_release

    assert verify_release(exported, key=_pub(exported)).ok
    assert not verify_release(exported).ok  # no trusted key: integrity alone is not a verdict
    report = verify_release(release, key=_pub(exported))
    assert not report.ok and {p.artifact for p in report.problems} == {"model.onnx"}
