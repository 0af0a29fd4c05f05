"""Optimizer-state memory and the loss curve of AdamW, 8-bit AdamW and Adafactor on the same run.

Each optimizer plugin (``adamw``, ``adamw8bit``, ``adafactor``) trains the same model from the same initial
weights on the same batches (character-level Tiny Shakespeare, the bundled corpus; random windows from one
seeded generator), one after the other. Recorded per optimizer: the bytes its state holds after the run
(every tensor in ``optimizer.state``, as allocated), bytes per parameter, the ratio to AdamW's, the
training loss at every step, the mean of the last 10 and a validation loss on fixed batches.

The learning rate is each optimizer's own: AdamW and 8-bit AdamW ``--lr`` (3e-3); Adafactor's lr is a
relative step size (torch's default 1e-2; ``--lr-adafactor``), so "same run" means same model, data,
steps, schedule (linear warmup then cosine) and clipping, not the same lr value.

    python packages/train/bench/optimizer_memory.py               # CUDA if present (bf16 autocast), else CPU
    python packages/train/bench/optimizer_memory.py --tiny        # seconds on CPU: proves the script

Appends JSON lines to ``<out>/optimizer-memory-<device>-<date>.jsonl`` (default: bench/results) and prints a
table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")
#: model sizes (a Llama block through plyx.model); "small" is nanoGPT's char recipe width, "gpu" a 124M-class one
SHAPES = {
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "seq_len": 32, "batch": 4},
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 344, "seq_len": 64, "batch": 12},
    "gpu": {"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 2048, "seq_len": 256, "batch": 32},
}


def _data(seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Character ids of the bundled Tiny Shakespeare (sorted characters, as nanoGPT's prepare.py): train, val."""
    from plyx.train import bundled_corpus

    text = bundled_corpus().read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n = int(0.9 * len(ids))
    return ids[:n], ids[n:], len(chars)


def _batches(data: torch.Tensor, count: int, batch: int, seq_len: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ix = torch.randint(len(data) - seq_len - 1, (batch,), generator=gen)
        window = torch.stack([data[i: i + seq_len + 1] for i in ix])  # (B, T + 1)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps per parameter (moments, codes, scales, factored statistics)."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def run(name: str, shape: dict[str, int], steps: int, lr: float, device: torch.device,
        train: list[tuple[torch.Tensor, ...]], val: list[tuple[torch.Tensor, ...]], vocab: int) -> dict[str, Any]:
    from plyx.model import TransformerLM
    from plyx.specs import Batch, ModelConfig, OptimizerConfig
    from plyx.train import build_optimizer, lm_loss

    torch.manual_seed(0)  # the same initial weights for every optimizer
    config = ModelConfig(vocab_size=vocab + (vocab % 2), d_model=shape["d_model"], n_layers=shape["n_layers"],
                         n_heads=shape["n_heads"], d_ff=shape["d_ff"], max_seq_len=shape["seq_len"],
                         tie_embeddings=True)
    model = TransformerLM(config, device=device)
    optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=lr, weight_decay=0.1, betas=(0.9, 0.99)))
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    warmup = max(1, steps // 10)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(steps):
        # linear warmup then cosine to 10%: the same schedule for every optimizer
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup)
                                                                                   / max(1, steps - warmup)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        ids, targets = (t.to(device) for t in train[step % len(train)])
        with autocast:
            loss = lm_loss(model, Batch(input_ids=ids, targets=targets))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read back after the run: no host sync per step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    with torch.no_grad(), autocast:
        val_loss = statistics.fmean(float(lm_loss(model, Batch(input_ids=i.to(device), targets=t.to(device))))
                                    for i, t in val)
    curve = [round(float(x), 5) for x in losses]
    n_params = sum(p.numel() for p in params)
    return {"optimizer": name, "lr": lr, "steps": steps, "params": n_params, "state_bytes": state_bytes(optimizer),
            "state_bytes_per_param": state_bytes(optimizer) / n_params, "loss_last10": statistics.fmean(curve[-10:]),
            "val_loss": val_loss, "ms_per_step": 1e3 * seconds / steps, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny shape on CPU, a few steps")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: gpu on CUDA, small on CPU")
    p.add_argument("--steps", type=int, help="default: 20 tiny, 300 small, 500 gpu")
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr of adamw and adamw8bit")
    p.add_argument("--lr-adafactor", type=float, default=1e-2, help="Adafactor's relative step size")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shape_name = "tiny" if args.tiny else args.shape or ("gpu" if device.type == "cuda" else "small")
    shape = SHAPES[shape_name]
    steps = args.steps or {"tiny": 20, "small": 300, "gpu": 500}[shape_name]
    names = [n for n in args.optimizers.split(",") if n]
    unknown = set(names) - set(OPTIMIZERS)
    if unknown:
        p.error(f"unknown optimizers {sorted(unknown)}; choose from {', '.join(OPTIMIZERS)}")
    train_ids, val_ids, vocab = _data(shape["seq_len"])
    train = _batches(train_ids, steps, shape["batch"], shape["seq_len"], seed=1)
    val = _batches(val_ids, 10, shape["batch"], shape["seq_len"], seed=2)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    print(f"{where}, torch {torch.__version__}, {date}: shape {shape_name} {shape}, {steps} steps")
    rows = []
    for name in names:
        row = run(name, shape, steps, args.lr_adafactor if name == "adafactor" else args.lr, device, train, val, vocab)
        row.update(device=where, date=date, torch=torch.__version__, shape=shape_name, **{f"shape_{k}": v for k, v in
                                                                                        shape.items()})
        rows.append(row)
    base = next((r for r in rows if r["optimizer"] == "adamw"), None)
    print(f"{'optimizer':>10} {'state':>12} {'B/param':>8} {'vs adamw':>9} {'loss(last10)':>13} {'val loss':>9} "
          f"{'ms/step':>8}")
    for r in rows:
        r["state_vs_adamw"] = r["state_bytes"] / base["state_bytes"] if base else None
        ratio = f"{1 / r['state_vs_adamw']:.1f}x less" if base and r is not base else "-"
        print(f"{r['optimizer']:>10} {r['state_bytes'] / 2**20:9.2f} MiB {r['state_bytes_per_param']:8.3f} "
              f"{ratio:>9} {r['loss_last10']:13.4f} {r['val_loss']:9.4f} {r['ms_per_step']:8.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = where.replace(" ", "-").lower()
    path = args.out / f"optimizer-memory-{slug}-{date}.jsonl"
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"appended {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
