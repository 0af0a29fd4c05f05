"""Scenario 2: train -> export -> governance verify.

The checkpoint of the session's training run is exported with the real command line
(``plyx export CKPT --format onnx --out DIR``, verified in onnxruntime by plyx-export;
while SYMINT_BUG stands, the same export made in-process, see ``export_run``),
plyx-governance's ``plyx_on_export_written`` hook turns the directory into a signed
release, and ``plyx governance verify DIR`` passes on it. One flipped byte of
``model.onnx`` then fails the gate with the file named. The graph's logits are also
checked here, in onnxruntime, against the torch model loaded from the same checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from plyx.export import ExportError

PLYX = [sys.executable, "-m", "plyx.specs"]


EXAMPLE_PLUGIN = "kernels-example"  # the reference third-party kernel plugin's entry-point name
PROBE_BUG = ("plyx-kernel Registry._decide runs the conformance probe of every third-party implementation, "
             "even one an override excludes, inside torch.export tracing (reference_kernels()); "
             "its .item() breaks the ONNX export")
SYMINT_BUG = ("plyx-kernel Registry.get's fast cache keys on tensor.shape; under torch.export the sizes are "
              "SymInts and hashing them raises TypeError: unhashable type: non-nested SymInt")


def _plyx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLYX, *args], capture_output=True, text=True, timeout=420,
                          env={**os.environ, **(env or {})})


def _without_example_plugin() -> dict[str, str]:
    """PLYX_PLUGINS allowing every discovered plugin but the example kernel plugin (see PROBE_BUG)."""
    from plyx.specs import plugins

    names = sorted(r.name for r in plugins.plugin_report() if r.name != EXAMPLE_PLUGIN)
    return {"PLYX_PLUGINS": ",".join(names)}


def _export(checkpoint: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return _plyx("export", str(checkpoint), "--format", "onnx", "--out", str(out), "--name", "tiny-llm", "--json",
                 env=env)


@contextlib.contextmanager
def _registry_without_fast_cache() -> Iterator[None]:
    """Work around SYMINT_BUG from the outside: ``Registry.get`` takes its slow path (``select``), as it
    did before the fast cache existed. Only the exports of this module run under it."""
    from plyx.kernel import Registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Registry, "_fast_key", lambda self, name, tensors, shape: None, raising=False)
        yield


class KnownBug(AssertionError):
    """Raised where a test meets the exact failure of a known plane bug (its xfail names this type)."""


@attrs.frozen
class Exported:
    cli: subprocess.CompletedProcess[str]  # ``plyx export`` as a user runs it
    path: Path  # the export the checks run on: the CLI's, or the in-process one while SYMINT_BUG stands


@pytest.fixture(scope="module")
def export_run(trained, tmp_path_factory) -> Exported:
    """``plyx export CKPT --format onnx --out DIR``. The example kernel plugin is left out of this one
    process (PROBE_BUG; the xfail test below exports with every plugin). If the command fails (SYMINT_BUG),
    the same export is made in-process with ``export_onnx`` and the fast cache bypassed, so the governance
    chain is still checked; ``test_plyx_export_command`` holds the command's own failure."""
    out = tmp_path_factory.mktemp("export") / "tiny-onnx"
    proc = _export(trained.checkpoint, out, env=_without_example_plugin())
    if proc.returncode == 0:
        return Exported(cli=proc, path=out)
    from plyx.export import export_onnx
    from plyx.model import load_checkpoint

    fallback = tmp_path_factory.mktemp("export-in-process") / "tiny-onnx"
    model = load_checkpoint(trained.checkpoint).eval()
    with _registry_without_fast_cache():
        export_onnx(model, fallback, source=trained.checkpoint, name="tiny-llm")
    return Exported(cli=proc, path=fallback)


@pytest.fixture(scope="module")
def exported(export_run) -> Path:
    return export_run.path


def _raise_if_symint_bug(checkpoint: Path, out: Path) -> None:
    """The command prints only the exporter's summary: find the cause by the same export in-process."""
    from plyx.export import export_onnx
    from plyx.kernel import reset_registry
    from plyx.model import load_checkpoint

    reset_registry()
    try:
        export_onnx(load_checkpoint(checkpoint).eval(), out, hooks=False)
    except ExportError as exc:
        if "unhashable type: non-nested SymInt" in "".join(traceback.format_exception(exc)):
            raise KnownBug(SYMINT_BUG) from exc
    finally:
        reset_registry()


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=SYMINT_BUG)
def test_plyx_export_command(export_run, trained, tmp_path):
    proc = export_run.cli
    if proc.returncode != 0:
        _raise_if_symint_bug(trained.checkpoint, tmp_path / "diagnose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["format"] == "onnx" and Path(result["path"]) == export_run.path.resolve()
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
    ok = _plyx("governance", "verify", str(exported))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("PASS")

    release = Path(shutil.copytree(exported, tmp_path / "tampered"))
    graph = release / "model.onnx"
    raw = bytearray(graph.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte in the middle of the weights
    graph.write_bytes(bytes(raw))
    bad = _plyx("governance", "verify", str(release))
    assert bad.returncode != 0, bad.stdout
    fails = [line for line in bad.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails and all("model.onnx" in line for line in fails), bad.stdout
    assert {"checksum", "receipt", "sbom"} <= {line.split("[", 1)[1].split("]", 1)[0] for line in fails}

    # the same gate from Python gives the same verdict (and leaves the untouched release passing)
    from plyx.governance import verify_release

    assert verify_release(exported).ok
    report = verify_release(release)
    assert not report.ok and {p.artifact for p in report.problems} == {"model.onnx"}


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=PROBE_BUG)
def test_export_with_every_plugin_installed(trained, tmp_path):
    """The export users get with plyx-kernels-example installed beside the planes, on a registry that
    has not selected ``swiglu`` yet (as in a fresh ``plyx export`` process)."""
    pytest.importorskip("plyx_kernels_example", reason="the example kernel plugin is not installed here")
    from plyx.export import export_onnx
    from plyx.kernel import reset_registry
    from plyx.model import load_checkpoint

    model = load_checkpoint(trained.checkpoint).eval()
    reset_registry()  # forget the conformance probes earlier tests ran eagerly
    try:
        with _registry_without_fast_cache():  # isolate PROBE_BUG from SYMINT_BUG
            try:
                result = export_onnx(model, tmp_path / "all-plugins", hooks=False)
            except ExportError as exc:
                trace = "".join(traceback.format_exception(exc))
                if "plyx/specs/testing/kernels" in trace:  # the conformance probe ran inside the trace
                    raise KnownBug(PROBE_BUG) from exc
                raise
    finally:
        reset_registry()
    assert result.verification.ok and (tmp_path / "all-plugins" / "model.onnx").is_file()
