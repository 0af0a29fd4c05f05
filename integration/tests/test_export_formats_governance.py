"""Scenario: train -> every export format -> governance verify, and the KV graph against plyx's decoder.

The session's trained checkpoint is exported with the real command line in each
format plyx-export ships (the ONNX decoding graph with a KV cache, its int8 version,
the Hugging Face directory, GGUF q8_0). plyx-governance's ``plyx_on_export_written``
hook turns every one into a signed release that ``plyx governance verify`` passes.
The KV graph then decodes 64 tokens greedily in onnxruntime, equal to what
``plyx.serve.generate`` (plyx's only decoder) produces from the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLYX = [sys.executable, "-m", "plyx.specs"]

FORMATS = {
    "onnx-kv": ["--format", "onnx", "--with-kv-cache"],
    "onnx-int8": ["--format", "onnx", "--with-kv-cache", "--quantize", "int8-dynamic"],
    "hf": ["--format", "hf"],
    "gguf-q8_0": ["--format", "gguf", "--outtype", "q8_0"],
}
#: files each format must hold besides governance's records
EXPECTED = {
    "onnx-kv": {"model.onnx", "plyx_export.json", "tokenizer.json"},
    "onnx-int8": {"model.onnx", "plyx_export.json", "tokenizer.json"},
    "hf": {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"},
    "gguf-q8_0": {"model-q8_0.gguf", "plyx_export.json"},
}
GOVERNANCE = {"RECEIPT.json", "SBOM.spdx.json", "CHECKSUMS.sha256", "CHECKSUMS.sha256.dsse.json", "SIGNING_KEY.pub",
              "MODEL_CARD.md"}


def _plyx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PLYX, *args], capture_output=True, text=True, timeout=420, env=dict(os.environ))


@pytest.fixture(scope="module", params=sorted(FORMATS))
def released(request: pytest.FixtureRequest, trained, tmp_path_factory) -> tuple[str, Path, dict]:
    out = tmp_path_factory.mktemp("formats") / request.param
    proc = _plyx("export", str(trained.checkpoint), *FORMATS[request.param], "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return request.param, out, json.loads(proc.stdout)


def test_every_format_is_verified_and_released(released) -> None:
    name, out, result = released
    assert result["verification"]["ok"], result["verification"]
    names = {p.name for p in out.iterdir()}
    assert EXPECTED[name] | GOVERNANCE <= names, sorted(names)
    checksums = (out / "CHECKSUMS.sha256").read_text()
    assert all(f in checksums for f in EXPECTED[name])
    # no kept signing key here: the release's own key checks integrity (signatures against a pinned key are
    # test_train_export_governance's)
    verdict = _plyx("governance", "verify", str(out), "--integrity-only")
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert verdict.stdout.strip().splitlines()[-1].startswith("PASS")


def test_kv_graph_greedy_equals_plyx_serve(trained, tmp_path: Path) -> None:
    import torch
    from plyx.export._verify_kv import KVSession
    from plyx.model import load_checkpoint
    from plyx.serve import SamplingParams, generate

    out = tmp_path / "kv"
    proc = _plyx("export", str(trained.checkpoint), "--format", "onnx", "--with-kv-cache", "--out", str(out),
                 "--no-hooks")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = load_checkpoint(trained.checkpoint).eval()
    prompt = torch.randint(1, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    served = generate(model, [prompt], SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    want = list(served[0].outputs[0].token_ids)
    assert len(want) == 64
    assert KVSession(out / "model.onnx").greedy(prompt, 64) == want
