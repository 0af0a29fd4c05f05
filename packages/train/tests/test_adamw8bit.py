"""``adamw8bit``: block-wise 8-bit AdamW moments: the quantiser's error, the state's size, and the loss curve
against ``torch.optim.AdamW`` on the same run."""

from __future__ import annotations

from pathlib import Path

import torch
from plyx.train import Trainer, TrainOptions
from plyx.train._adamw8bit import BLOCK, AdamW8bit, dequantize_blockwise, dynamic_code, quantize_blockwise

QUIET = {"progress": False, "tensorboard": False}


def test_dynamic_code_and_round_trip() -> None:
    for signed in (True, False):
        code = dynamic_code(signed)
        assert code.shape == (256,) and torch.all(code[1:] >= code[:-1]) and code.max() == 1.0
        assert (code.min() < 0) == signed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 77, generator=g) * torch.logspace(-4, 0, 3 * BLOCK + 77)  # 4 decades inside blocks
    codes, absmax = quantize_blockwise(x, signed=True)
    assert codes.dtype == torch.uint8 and absmax.shape == (4,)
    back = dequantize_blockwise(codes, absmax, True, x)
    # relative to each block's absmax, the dynamic code's step near 1 is ~1/64 (signed): error <= half of it
    err = (back - x).abs() / absmax.repeat_interleave(BLOCK)[: x.numel()]
    assert err.max() < 1 / 64
    # small values keep their magnitude (a linear 8-bit code would round everything under absmax/254 to 0)
    small = x.abs() < absmax.repeat_interleave(BLOCK)[: x.numel()] / 254
    assert ((back[small] - x[small]).abs() <= 0.2 * x[small].abs() + 1e-9).float().mean() > 0.9


def test_state_is_about_four_times_smaller() -> None:
    w = torch.nn.Parameter(torch.randn(256, 64))  # 16384 values: quantised
    b = torch.nn.Parameter(torch.randn(64))  # under MIN_8BIT: float32 moments
    opt = AdamW8bit([w, b], lr=1e-3)
    (w.sum() + b.sum()).backward()
    opt.step()
    ref = torch.optim.AdamW([w, b], lr=1e-3)
    ref.step()
    ref_bytes = sum(t.numel() * t.element_size() for s in ref.state.values() for t in s.values())
    assert opt.state_bytes() < ref_bytes / 3.5  # 2 bytes + scales per value vs 8 for the weight


def test_loss_curve_follows_adamw(tiny_config, prepared: Path, tmp_path: Path) -> None:
    curves = {}
    for name in ("adamw", "adamw8bit"):
        # d_model 64 and d_ff 128: the projections hold >= 4096 values, so their moments are 8-bit
        cfg = tiny_config(prepared, tmp_path / name, steps=30, eval_every=0, checkpoint_every=0, sample_tokens=0,
                          log_every=10, optimizer={"name": name},
                          model={"d_model": 64, "d_ff": 128, "n_heads": 4})
        trainer = Trainer(cfg, options=TrainOptions(**QUIET))
        curves[name] = trainer.fit().losses
        if name == "adamw8bit":
            quantised = [s for s in trainer.optimizer.state.values() if "m_codes" in s]
            assert len(quantised) >= 8
    a, q = torch.tensor(curves["adamw"]), torch.tensor(curves["adamw8bit"])
    assert q[-5:].mean() < 0.8 * q[:3].mean()  # it trains
    # same run, same data: the curves stay within 3% of each other at every step
    print(f"max relative gap {((q - a).abs() / a).max():.4f}; final {a[-1]:.4f} vs {q[-1]:.4f}")
    assert ((q - a).abs() / a).max() < 0.03, (a.tolist(), q.tolist())
