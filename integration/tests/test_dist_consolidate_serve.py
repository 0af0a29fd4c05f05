"""Scenario: train on 2 ranks with FSDP2 -> ``plyx dist consolidate`` -> ``plyx serve`` answers.

plyx-dist plugs into plyx-train's Trainer through the ``plyx_train_strategy`` hook (train never
imports dist). ``plyx train CONFIG --nproc 2`` runs FSDP2 on 2 gloo ranks and writes sharded (DCP)
checkpoints; ``plyx dist consolidate`` turns the last one into a plain plyx checkpoint; the
server built as ``plyx serve CKPT`` runs loads it and answers the official ``openai`` client with
exactly what ``plyx.serve.generate`` gives on the same weights. The consolidated weights equal
those of a single-process run of the same config at the same global batch (batch 2 x 2 ranks =
4) within 1e-5 absolute: float32 rounding of the all-reduced / reduce-scattered sums over six
AdamW steps, the tolerance of plyx-dist's loss-parity tests.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("plyx.dist")
pytest.importorskip("uvicorn")

WORDS = "the king and queen of the realm spoke to their people about war and peace honour love".split()


def _config(data: Path, out: Path, batch_size: int, dist: dict | None = None):
    from plyx.specs import DataConfig, DistConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig

    return TrainConfig(
        model=ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64),
        data=DataConfig(path=str(data), seq_len=16, mode="windows", val_fraction=0.2, vocab_size=300),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=1.0), schedule=ScheduleConfig(kind="cosine", warmup_steps=1),
        steps=6, batch_size=batch_size, device="cpu", out_dir=str(out), log_every=2, eval_every=0,
        checkpoint_every=0, sample_tokens=0, dist=DistConfig(**(dist or {})),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from plyx.train import Trainer, TrainOptions, prepare_corpus

    root = tmp_path_factory.mktemp("dist")
    rng = random.Random(1)
    text = "\n\n".join(f"SPEAKER {i % 5}:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30)))
                       for i in range(90))
    (root / "corpus.txt").write_text(text + "\n", encoding="utf-8")
    prepare_corpus(root / "corpus.txt", root / "data", vocab_size=300, val_fraction=0.2, separator="\n\n",
                   use_hooks=False)
    config = root / "fsdp.json"
    config.write_text(json.dumps(_config(root / "data", root / "fsdp", 2, {"strategy": "fsdp"}).to_dict()))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PLYX_DATA_DIR=str(root / "cache"))
    plyx = [sys.executable, "-m", "plyx.specs"]
    proc = subprocess.run([*plyx, "train", str(config), "--nproc", "2", "--no-progress", "--no-tensorboard"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = subprocess.run([*plyx, "dist", "consolidate", str(root / "fsdp"), str(root / "plain")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = Trainer(_config(root / "data", root / "single", 4),
                     options=TrainOptions(progress=False, tensorboard=False, handle_signals=False)).fit()
    return {"plain": root / "plain", "single": Path(single.checkpoint)}


def test_consolidated_weights_match_a_single_process_run(runs):
    from plyx.model import load_checkpoint

    got, want = load_checkpoint(runs["plain"]).state_dict(), load_checkpoint(runs["single"]).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_plyx_serve_answers_from_the_consolidated_checkpoint(runs):
    from plyx.model import load_checkpoint
    from plyx.serve import SamplingParams, generate
    from plyx.serve.server import build_server, serve_in_thread
    from plyx.specs.config.serve import ServeConfig
    from tokenizers import Tokenizer

    cfg = ServeConfig(model=str(runs["plain"]), served_name="tiny", device="cpu", dtype="float32",
                      max_batch_size=2, max_batch_tokens=128)
    app = build_server(cfg, chat_template="plain")
    tok = Tokenizer.from_file(str(runs["plain"] / "tokenizer.json"))
    prompt = "SPEAKER 2:\nThe king"
    want = generate(load_checkpoint(runs["plain"]).eval(), [tok.encode(prompt).ids],
                    SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True), tokenizer=tok)[0]
    with serve_in_thread(app, timeout_graceful_shutdown=5) as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert answer.choices[0].text == want.outputs[0].text
    assert answer.usage.completion_tokens == 8
