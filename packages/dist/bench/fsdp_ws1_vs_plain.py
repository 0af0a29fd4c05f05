"""FSDP2 at world size 1 against plyx-train's plain single-device path, in one run, same model and batch.

The question (issue 17): what does the FSDP2 code path cost when there is nothing to shard?
Both runs are real ``plyx train`` runs on the bundled Tiny Shakespeare, one after the other on
the same device:

- ``plain``: ``plyx train CONFIG`` (no launcher: the Trainer's own single-device loop);
- ``fsdp``:  ``plyx train CONFIG`` with ``[dist] strategy = "fsdp"`` and torchrun's variables for
  one rank (``WORLD_SIZE=1``...: what ``--nproc 1`` gives the rank it spawns): NCCL process group
  of one rank, ``fully_shard`` per block + root, meta-device init, ``MixedPrecisionPolicy`` (bf16
  parameters; at one rank no reshard after forward and the reduction in bf16, see plyx-dist's
  README).

Both use ``precision = "bf16-autocast"`` on CUDA and run through ``_kernel_trace.py``, which
records the kernel implementation that served each kernel name (printed, and stored in each row):
the Triton kernels must serve both paths. Tokens/s and MFU are the last logged window (the first
window, with its warm-up, is not the last when ``--steps`` > ``--log-every``); ``ms_per_step`` is
that window's mean, ``tokens per step / tokens_per_s``. (Rows before 2026-11-24T17 recorded the
Trainer's ``ms_per_step`` column instead: the host time of the window's last step alone, measured
before the device finished it, which disagreed with the window's tokens/s: 137.6 ms recorded for
FSDP where its 25,178 tok/s mean 162.7 ms.)
The ``gpu`` preset is a ~1.1B-parameter Llama shape (d 2048, 16 layers, 32 heads / 8 KV heads,
FFN 8192, vocab 32768, T 1024); ``tiny`` proves the script on CPU (gloo) in seconds.

    python packages/dist/bench/fsdp_ws1_vs_plain.py                  # CUDA: the gpu preset
    python packages/dist/bench/fsdp_ws1_vs_plain.py --preset tiny    # CPU proof

Rows go to ``results/fsdp_ws1_vs_plain.jsonl``; the overhead is ``1 - fsdp / plain`` tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import _runs

PRESETS = {
    # model, seq_len, batch, steps, log_every
    "gpu": ({"arch": "llama", "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192,
             "vocab_size": 32768, "max_seq_len": 1024}, 1024, 4, 40, 20),
    "tiny": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 192, "vocab_size": 1024, "max_seq_len": 64},
             64, 4, 6, 3),
}


def config(preset: str, out: Path, data: Path, *, fsdp: bool, cuda: bool, batch: int | None = None,
           steps: int | None = None) -> dict:
    model, seq, preset_batch, preset_steps, log_every = PRESETS[preset]
    batch, steps = batch or preset_batch, steps or preset_steps
    cfg = {
        "model": {**model, "tie_embeddings": False}, "data": {"path": str(data), "seq_len": seq},
        "steps": steps, "batch_size": batch, "precision": "bf16-autocast" if cuda else "float32",
        "device": "auto", "out_dir": str(out), "log_every": log_every, "eval_every": 0, "checkpoint_every": 0,
        "sample_tokens": 0, "schedule": {"warmup_steps": 1},
    }
    if fsdp:
        cfg["dist"] = {"strategy": "fsdp", "param_dtype": "bfloat16" if cuda else "float32",
                       "reduce_dtype": "float32"}
    return cfg


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "tiny")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (known GPUs are looked up)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's; lower on OOM)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    p.add_argument("--out", default=str(_runs.RESULTS / "fsdp_ws1_vs_plain.jsonl"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="plyx-fsdp-ws1-") as tmp:
        work = Path(tmp)
        data = _runs.prepare_data(work)
        rows = []
        for name, fsdp in (("plain", False), ("fsdp", True)):
            cfg = config(args.preset, work / name, data, fsdp=fsdp, cuda=cuda, batch=args.batch, steps=args.steps)
            trace = work / f"kernels-{name}.json"
            m = _runs.train(cfg, work / f"cfg-{name}", nproc=None, one_rank=fsdp, peak_flops=args.peak_flops,
                            kernels=trace)
            kernels = json.loads(trace.read_text(encoding="utf-8"))
            tokens_per_step = cfg["batch_size"] * cfg["data"]["seq_len"]
            rows.append({"bench": "fsdp_ws1_vs_plain", "path": name, "preset": args.preset,
                         "tokens_per_s": m["tokens_per_s"], "mfu": m.get("mfu"), "peak_mem_mb": m.get("peak_mem_mb"),
                         # the same window as tokens_per_s (metrics.csv's ms_per_step is one step's host time)
                         "ms_per_step": 1e3 * tokens_per_step / m["tokens_per_s"], "batch": cfg["batch_size"],
                         "seq_len": cfg["data"]["seq_len"], "precision": cfg["precision"],
                         "kernels": {f"{k['kernel']}[{k['dtype']}]": k["impl"] for k in kernels},
                         "dtensor_args": sorted({k["kernel"] for k in kernels if "DTensor" in k["tensor_types"]}),
                         "device": _runs.device_name(), "date": _runs.now()})
            mfu = f"{m['mfu']:.4f}" if m.get("mfu") is not None else "-"
            print(f"{name:>6}: {m['tokens_per_s']:>12,.0f} tok/s  {rows[-1]['ms_per_step']:.1f} ms/step  mfu {mfu}  "
                  f"peak {m.get('peak_mem_mb', 0):,.0f} MB", flush=True)
            print("        kernels: " + ", ".join(f"{k}={v}" for k, v in rows[-1]["kernels"].items()), flush=True)
            if rows[-1]["dtensor_args"]:
                print(f"        DTensor arguments reached: {', '.join(rows[-1]['dtensor_args'])}", flush=True)
        overhead = 1 - rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        for row in rows:
            row["fsdp_overhead"] = overhead
        print(f"FSDP2 at world size 1 costs {overhead:+.1%} tokens/s against the plain path ({_runs.device_name()})")
        _runs.append(Path(args.out), rows)
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
