"""Scenario 1: train -> checkpoint -> serve, with the governance receipt written by a hook.

plyx-train writes a plain plyx-model checkpoint (plus its tokenizer); plyx-model loads it;
plyx-serve's greedy ``generate`` (KV cache, fused argmax) produces exactly the ids of a
hand-written greedy loop over the model's full forward without a cache. plyx-governance,
only installed, wrote RECEIPT.json into the checkpoint through ``plyx_on_checkpoint_saved``,
and its replay passes from Python and from ``plyx governance receipt verify``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PLYX = [sys.executable, "-m", "plyx.specs"]
NEW_TOKENS = 12


def _greedy_no_cache(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """argmax of the last position of a full forward over the whole sequence, ``steps`` times."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]))  # (1, T, V)
            ids.append(int(logits[0, -1].float().argmax()))
    return ids[len(prompt):]


def test_training_ran_and_the_checkpoint_is_a_model_checkpoint(trained):
    from plyx.model import load_checkpoint, open_checkpoint

    assert len(trained.losses) == 6 and all(map(torch.isfinite, torch.tensor(trained.losses)))
    assert trained.losses[-1] < trained.losses[0]  # 6 steps at lr 1e-2 already move a 4-token-batch loss down
    model = load_checkpoint(trained.checkpoint)
    assert model.config == trained.config.model
    assert open_checkpoint(trained.checkpoint).config == trained.config.model
    assert (trained.checkpoint / "tokenizer.json").is_file()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_serve_greedy_equals_a_full_forward_greedy_loop(trained, cache):
    from plyx.model import load_checkpoint
    from plyx.serve import SamplingParams, generate
    from tokenizers import Tokenizer

    model = load_checkpoint(trained.checkpoint).eval()
    tok = Tokenizer.from_file(str(trained.checkpoint / "tokenizer.json"))
    prompts = [tok.encode("SPEAKER 2:\nThe king").ids, tok.encode("Peace and").ids]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = generate(model, prompts, params, tokenizer=tok, cache=cache)  # batched: left-padded prefill
    for prompt, out in zip(prompts, outs):
        want = _greedy_no_cache(model, prompt, NEW_TOKENS)
        got = list(out.outputs[0].token_ids)
        assert got == want, f"prompt {prompt}: serve {got} != full-forward greedy {want}"
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(want)


def test_governance_hook_wrote_a_receipt_that_replays(trained):
    from plyx.governance import load_receipt, verify_receipt

    receipt_path = trained.checkpoint / "RECEIPT.json"
    assert receipt_path.is_file(), "plyx-governance is installed: its checkpoint hook must write RECEIPT.json"
    receipt = load_receipt(receipt_path)
    assert receipt["kind"] == "checkpoint" and receipt["step"] == 6
    assert receipt["config"]["model"]["d_model"] == trained.config.model.d_model
    assert receipt["seeds"]["seed"] == trained.config.seed
    assert {e["name"] for e in receipt["inputs"]} >= {"tokenizer", "manifest"}
    report = verify_receipt(receipt_path)
    assert report.ok, "\n".join(report.lines())
    assert any("byte-equal" in line for line in report.passed)

    proc = subprocess.run([*PLYX, "governance", "receipt", "verify", str(receipt_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS")


def test_a_checkpoint_changed_after_training_fails_the_replay(trained, tmp_path):
    """The receipt binds the weights: one flipped byte in a copy of the run is named."""
    from plyx.governance import verify_receipt

    run = shutil.copytree(trained.out_dir, tmp_path / "run", symlinks=True)  # relative paths stay valid
    ckpt = Path(run) / trained.checkpoint.relative_to(trained.out_dir)
    weights = ckpt / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    before = hashlib.sha256(raw).hexdigest()
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    assert hashlib.sha256(weights.read_bytes()).hexdigest() != before
    assert verify_receipt(ckpt / "RECEIPT.json").ok is False

    # and the checkpoint itself refuses to load (its own sha256 table), naming the shard
    from plyx.model import CheckpointIntegrityError, load_checkpoint

    with pytest.raises(CheckpointIntegrityError, match="model.safetensors"):
        load_checkpoint(ckpt)
    json.loads((ckpt / "RECEIPT.json").read_text())  # the receipt itself was not touched
