"""Tokens/s and MFU of DDP, FSDP and FSDP+TP at 1, 2 and 4 ranks: the same model, the same global batch.

Each point is one real ``plyx train CONFIG --nproc N`` run (gloo on CPU, NCCL on GPUs) on the
bundled Tiny Shakespeare; the per-rank batch is the global batch over the data-parallel ranks
(FSDP+TP at tp 2 has half as many). The numbers are the last logged window of the run
(``tokens_per_s``: global tokens over wall time; ``mfu``: ``6N + 12LHDT`` FLOPs per token
times tokens/s over ``world x peak``), so the first, compiling window is left out when
``--steps`` > ``--log-every``. FSDP+TP at 1 rank does not exist (tp_size >= 2) and is skipped.

    python packages/dist/bench/scaling.py                       # CPU: a 4-layer 128-wide model
    python packages/dist/bench/scaling.py --preset gpu          # GPU: a 12-layer 768-wide model, bf16

Rows go to ``results/scaling.jsonl`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _runs

PRESETS = {
    # name: model, seq_len, global batch, precision, param dtype
    "cpu": ({"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 384, "vocab_size": 1024, "max_seq_len": 128},
            128, 8, "float32", "float32"),
    "gpu": ({"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072, "vocab_size": 32768, "max_seq_len": 1024},
            1024, 16, "bf16-autocast", "bfloat16"),
}


def config(preset: str, strategy: str, world: int, out: Path, data: Path, steps: int, log_every: int) -> dict:
    model, seq, global_batch, precision, param_dtype = PRESETS[preset]
    tp = 2 if strategy == "fsdp+tp" else 1
    dp = world // tp
    dist = {"strategy": strategy, "tp_size": tp}
    if strategy != "ddp":
        dist.update(param_dtype=param_dtype, reduce_dtype="float32")
    return {
        "model": {**model, "tie_embeddings": False}, "data": {"path": str(data), "seq_len": seq},
        "steps": steps, "batch_size": global_batch // dp, "precision": precision, "device": "auto",
        "out_dir": str(out), "log_every": log_every, "eval_every": 0, "checkpoint_every": 0, "sample_tokens": 0,
        "schedule": {"warmup_steps": 1}, "dist": dist,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--strategies", default="ddp,fsdp,fsdp+tp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--log-every", type=int, default=6)
    p.add_argument("--peak-flops", type=float, default=None, help="per-device peak FLOP/s for MFU (CPU: required "
                   "for an MFU figure; known GPUs are looked up)")
    p.add_argument("--out", default=str(_runs.RESULTS / "scaling.jsonl"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plyx-scaling-") as tmp:
        work = Path(tmp)
        data = _runs.prepare_data(work)
        rows = []
        for strategy in args.strategies.split(","):
            for world in map(int, args.worlds.split(",")):
                if strategy == "fsdp+tp" and world < 2:
                    continue
                cfg = config(args.preset, strategy, world, work / f"{strategy}-{world}", data, args.steps,
                             args.log_every)
                m = _runs.train(cfg, work / f"cfg-{strategy}-{world}", nproc=world, peak_flops=args.peak_flops)
                row = {"bench": "scaling", "preset": args.preset, "strategy": strategy, "world_size": world,
                       "global_batch": cfg["batch_size"] * (world // cfg["dist"]["tp_size"]),
                       "seq_len": cfg["data"]["seq_len"], "tokens_per_s": m["tokens_per_s"],
                       "tokens_per_s_per_rank": m["tokens_per_s"] / world, "mfu": m.get("mfu"),
                       "peak_mem_mb": m.get("peak_mem_mb"), "allreduce_share": m.get("allreduce_share"),
                       "device": _runs.device_name(), "date": _runs.now()}
                rows.append(row)
                mfu = f"{row['mfu']:.4f}" if row["mfu"] is not None else "-"
                print(f"{strategy:>8} x{world}: {row['tokens_per_s']:>10,.0f} tok/s "
                      f"({row['tokens_per_s_per_rank']:,.0f}/rank)  mfu {mfu}", flush=True)
        _runs.append(Path(args.out), rows)
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
