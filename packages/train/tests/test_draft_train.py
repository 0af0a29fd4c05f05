"""``plyx train`` with a ``[draft]`` table: the Medusa and EAGLE losses against the papers' formulas, the base
frozen, accuracy above chance after training, the heads written and bad input named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from plyx.specs import ConfigError, TrainConfig
from plyx.train._draft_loss import eagle_loss, medusa_loss


def _tiny_config(data_dir: Path, out_dir: Path, **changes: object) -> TrainConfig:
    """A 2-layer, 32-wide model on the tiny corpus (conftest's tiny_config, at module scope)."""
    doc = {
        "model": {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
        "data": {"path": str(data_dir), "seq_len": 16, "val_fraction": 0.2, "vocab_size": 300},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1}, "schedule": {"warmup_steps": 1},
        "steps": 8, "batch_size": 4, "device": "cpu", "out_dir": str(out_dir), "log_every": 2,
    }
    for key, value in changes.items():
        doc[key] = {**doc[key], **value} if isinstance(value, dict) else value
    return TrainConfig.from_dict(doc)


# -- losses against the formulas, written out element by element ------------------------------
def test_medusa_loss_is_the_weighted_sum_of_head_cross_entropies():
    torch.manual_seed(0)
    K, B, T, V = 3, 2, 7, 11
    logits = torch.randn(K, B, T, V, dtype=torch.float64)
    x = torch.randint(0, V, (B, T + 1))
    targets = x[:, 1:].clone()  # y_t = x_{t+1}
    targets[1, 4] = -100  # an ignored label
    loss, acc = medusa_loss(logits, targets, decay=0.8)
    want = 0.0
    for k in range(1, K + 1):
        terms, hits = [], []
        for b in range(B):
            for t in range(T - k):
                label = int(targets[b, t + k])  # x_{t+k+1}
                if label == -100:
                    continue
                terms.append(-float(logits[k - 1, b, t].log_softmax(-1)[label]))
                hits.append(int(logits[k - 1, b, t].argmax()) == label)
        want += 0.8 ** k * sum(terms) / len(terms)
        assert abs(float(acc[k - 1]) - sum(hits) / len(hits)) < 1e-6
    assert abs(float(loss) - want) < 1e-10


def test_medusa_loss_masks_labels_from_another_document():
    torch.manual_seed(1)
    logits = torch.randn(2, 1, 6, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (1, 6))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    loss, _ = medusa_loss(logits, targets, decay=0.5, document_ids=docs)
    loss.backward()
    # head 1 at position 2 would read label y_3 from document 1: no gradient reaches it
    assert float(logits.grad[0, 0, 2].abs().sum()) == 0.0
    assert float(logits.grad[0, 0, 1].abs().sum()) > 0.0


def test_medusa_self_distillation_targets_the_base_distribution():
    torch.manual_seed(3)
    K, B, T, V = 2, 2, 6, 7
    logits = torch.randn(K, B, T, V, dtype=torch.float64)
    teacher = torch.randn(B, T, V, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T))
    targets[0, 5] = -100
    loss, acc = medusa_loss(logits, targets, decay=0.8, teacher_logits=teacher)
    want = 0.0
    for k in range(1, K + 1):
        terms, hits = [], []
        for b in range(B):
            for t in range(T - k):
                if int(targets[b, t + k]) == -100:
                    continue
                p = teacher[b, t + k].softmax(-1)  # the base's distribution over x_{t+k+1}
                terms.append(-float((p * logits[k - 1, b, t].log_softmax(-1)).sum()))
                hits.append(int(logits[k - 1, b, t].argmax()) == int(teacher[b, t + k].argmax()))
        want += 0.8 ** k * sum(terms) / len(terms)
        assert abs(float(acc[k - 1]) - sum(hits) / len(hits)) < 1e-6
    assert abs(float(loss) - want) < 1e-10


def test_eagle_loss_is_smooth_l1_plus_soft_cross_entropy():
    torch.manual_seed(2)
    B, N, D, V = 2, 5, 4, 9
    pred = torch.randn(B, N, D, dtype=torch.float64)
    feats = torch.randn(B, N, D, dtype=torch.float64)
    W = torch.randn(V, D, dtype=torch.float64)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 3] = False
    loss, parts = eagle_loss(pred, feats, W, cls_weight=0.1, mask=mask)
    regs, clss, hits = [], [], []
    for b in range(B):
        for i in range(N):
            if not mask[b, i]:
                continue
            diff = (pred[b, i] - feats[b, i]).abs()
            regs.append(float(torch.where(diff < 1, 0.5 * diff ** 2, diff - 0.5).mean()))  # SmoothL1, beta 1
            p = (W @ feats[b, i]).softmax(-1)
            clss.append(-float((p * (W @ pred[b, i]).log_softmax(-1)).sum()))
            hits.append(int((W @ pred[b, i]).argmax()) == int((W @ feats[b, i]).argmax()))
    reg, cls = sum(regs) / len(regs), sum(clss) / len(clss)
    assert abs(float(parts["reg"]) - reg) < 1e-10 and abs(float(parts["cls"]) - cls) < 1e-10
    assert abs(float(loss) - (reg + 0.1 * cls)) < 1e-10
    assert abs(float(parts["accuracy"]) - sum(hits) / len(hits)) < 1e-6


# -- the training mode ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, prepared) -> Path:
    """A tiny base trained briefly on the tiny corpus (the heads' frozen base)."""
    from plyx.train._trainer import Trainer, TrainOptions

    out = tmp_path_factory.mktemp("base")
    cfg = _tiny_config(prepared, out, steps=30, eval_every=0, checkpoint_every=0, sample_tokens=0)
    result = Trainer(cfg, options=TrainOptions(progress=False, tensorboard=False)).fit()
    assert result.checkpoint is not None
    return result.checkpoint


def _draft_config(prepared: Path, out: Path, base: Path, **draft) -> TrainConfig:
    cfg = _tiny_config(prepared, out, steps=40, eval_every=40, checkpoint_every=0, sample_tokens=0, log_every=10,
                       optimizer={"lr": 3e-3, "weight_decay": 0.0}, batch_size=8)
    return TrainConfig.from_dict({**cfg.to_dict(), "draft": {"base": str(base), "num_heads": 2, **draft}})


@pytest.mark.parametrize("kind, targets", [("medusa", "data"), ("medusa", "base"), ("eagle", "data")])
def test_training_raises_head_accuracy_above_chance_with_the_base_frozen(prepared, base_checkpoint, tmp_path, kind,
                                                                        targets):
    from plyx.model import load_checkpoint, load_draft_heads
    from plyx.train._draft import DraftTrainer

    cfg = _draft_config(prepared, tmp_path, base_checkpoint, kind=kind, targets=targets)
    trainer = DraftTrainer(cfg, progress=False, tensorboard=False)
    before = {k: v.clone() for k, v in trainer.base.state_dict().items()}
    result = trainer.fit()
    assert result.step == 40 and result.stopped is None and all(math.isfinite(x) for x in result.losses)
    assert not any(p.requires_grad for p in trainer.base.parameters())
    assert all(torch.equal(before[k], v) for k, v in trainer.base.state_dict().items())  # the base never changed
    V = trainer.base.config.vocab_size
    n = 2 if kind == "medusa" else 1
    for k in range(1, n + 1):  # validation accuracy of every head, far above 1 / V
        assert result.metrics[f"val_acc/head{k}"] > 10 / V, result.metrics
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    heads = load_draft_heads(result.heads, load_checkpoint(base_checkpoint))
    assert heads.kind == kind
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert "acc/head1" in header


def test_plyx_train_cli_runs_the_draft_mode(prepared, base_checkpoint, tmp_path, capsys):
    from plyx.specs import dump_config
    from plyx.specs.cli import main

    cfg = _draft_config(prepared, tmp_path / "run", base_checkpoint, kind="medusa")
    path = tmp_path / "draft.toml"
    dump_config(cfg, path)
    assert main(["train", str(path), "--steps", "10", "--no-progress", "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert "medusa draft heads" in out and "acc h1" in out and "draft heads:" in out
    assert (tmp_path / "run" / "draft-heads" / "draft_heads.safetensors").is_file()


def test_bad_draft_input_is_named(prepared, tmp_path):
    from plyx.train._draft import DraftTrainer

    with pytest.raises(ConfigError, match=r"none is given - at `\$\.draft\.base`"):
        TrainConfig.from_dict({"draft": {"kind": "medusa"}})
    with pytest.raises(ConfigError, match="hydra"):
        TrainConfig.from_dict({"draft": {"kind": "hydra", "base": "x"}})
    (tmp_path / "notckpt").mkdir()
    cfg = _draft_config(prepared, tmp_path / "run", tmp_path / "notckpt")
    with pytest.raises(ConfigError, match=r"cannot be loaded as a checkpoint.*at `draft\.base`"):
        DraftTrainer(cfg, progress=False, tensorboard=False)


def test_training_loss_matches_the_module_loss(prepared, base_checkpoint, tmp_path):
    """The trainer's Medusa loss on a batch is medusa_loss on the base's hidden states (no hidden shortcut)."""
    from plyx.train._draft import DraftTrainer

    trainer = DraftTrainer(_draft_config(prepared, tmp_path, base_checkpoint, kind="medusa", decay=0.5),
                           progress=False, tensorboard=False)
    batch = trainer.train_data.batch(0)
    loss, _ = trainer.loss(batch)
    with torch.no_grad():
        h = trainer.base(batch.input_ids, return_hidden=True)
        logits = trainer.heads(h)
    want = sum(0.5 ** k * F.cross_entropy(logits[k - 1, :, :-k].reshape(-1, logits.shape[-1]),
                                          batch.targets[:, k:].reshape(-1), ignore_index=-100) for k in (1, 2))
    assert abs(float(loss.detach()) - float(want)) < 1e-5


def test_interrupt_saves_the_heads_so_far(prepared, base_checkpoint, tmp_path):
    """Ctrl-C mid-run: the heads of the completed steps are written (atomically) and the result says so."""
    from plyx.model import load_draft_heads
    from plyx.train._draft import DraftTrainer

    trainer = DraftTrainer(_draft_config(prepared, tmp_path, base_checkpoint, kind="eagle"), progress=False,
                           tensorboard=False)
    real, calls = trainer.loss, []

    def interrupted(batch):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(batch)

    trainer.loss = interrupted
    result = trainer.fit()
    assert result.stopped == "SIGINT" and result.step == 3
    heads = load_draft_heads(result.heads)
    assert torch.equal(heads.fc.weight, trainer.heads.fc.weight.detach().cpu())
