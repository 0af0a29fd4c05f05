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
    python packages/dist/bench/fsdp_ws1_vs_plain.py --profile        # + where the difference goes

Rows go to ``results/fsdp_ws1_vs_plain.jsonl``; the overhead is ``1 - fsdp / plain`` tokens/s.

Each row also carries ``cpu_ms_per_step``, the process's CPU time per step after the first log window:
on a shared CPU machine it is what other jobs do not inflate (wall time is); on CUDA it includes the
host's spinning waits for the device, so there the profile's ``op_cpu_ms_per_step`` (host op time
without synchronisation) is the host figure to read. ``--repeat N`` alternates N runs per path and
keeps medians; ``--before`` adds ``fsdp-dtensor``, the FSDP path of plyx-dist 1.2 (optimizer step and
clipping on DTensors, ``PLYX_DIST_LOCAL_WS1=0``).

``--profile``: after the timed runs, one more short run of each path under ``torch.profiler``
(``_step_profile.py``: ``--profile-steps`` steps after ``--profile-warmup`` steps), printed side by
side: kernel time and launches per step by kind (GEMM, attention, elementwise/copy, norm, loss,
optimizer, collective, memcpy/memset), host time per step, and the kernels and ops that differ most.
The comparison goes to ``results/fsdp_ws1_profile-<device>-<date>.{json,txt}`` (``--profile-dir``).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import _runs
import _step_profile

PRESETS = {
    # model, seq_len, batch, steps, log_every
    "gpu": ({"arch": "llama", "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192,
             "vocab_size": 32768, "max_seq_len": 1024}, 1024, 4, 40, 20),
    "tiny": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 192, "vocab_size": 1024, "max_seq_len": 64},
             64, 4, 20, 10),
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


def profile_paths(args: argparse.Namespace, work: Path, data: Path, cuda: bool) -> None:
    """One short run per path under ``torch.profiler``; the comparison printed and written (see the docstring).

    With ``--before`` the FSDP path of plyx-dist 1.2 (``fsdp-dtensor``) is profiled too and compared with
    the current one.
    """
    start, n = args.profile_warmup, args.profile_steps or (3 if cuda else 10)
    steps = start + n + 2  # step start + n is reported one step late when the loss is read a step late (CUDA)
    names = ["plain", "fsdp"] + (["fsdp-dtensor"] if args.before else [])
    profiles: dict[str, Any] = {}
    for name in names:
        fsdp, env = PATHS[name]
        cfg = config(args.preset, work / f"prof-{name}", data, fsdp=fsdp, cuda=cuda, batch=args.batch, steps=steps)
        cfg["log_every"] = steps
        out = work / f"profile-{name}.json"
        _runs.train(cfg, work / f"cfg-prof-{name}", nproc=None, one_rank=fsdp, peak_flops=args.peak_flops,
                    kernels=work / f"kernels-prof-{name}.json", profile=(out, start, n), async_stats=True,
                    extra_env=env)
        profiles[name] = json.loads(out.read_text(encoding="utf-8"))
    device, date = _runs.device_name(), _runs.now()
    pairs = [("plain", "fsdp")] + ([("fsdp-dtensor", "fsdp")] if args.before else [])
    comparisons, texts = {}, []
    for a, b in pairs:
        comparisons[f"{a}:{b}"] = cmp = _step_profile.compare(profiles[a], profiles[b])
        texts.append(f"== {b} against {a}: torch.profiler over {n} steps after {start} (preset {args.preset}, "
                     f"batch {args.batch or PRESETS[args.preset][2]}, {device}, {date})\n"
                     + _step_profile.format_compare(cmp, (a, b), cuda=cuda))
    text = "\n".join(texts)
    print(text, flush=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    stem = Path(args.profile_dir) / f"fsdp_ws1_profile-{slug}-{date[:10]}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": "fsdp_ws1_profile", "preset": args.preset, "device": device, "date": date, "steps": n,
           "warmup": start, "batch": args.batch or PRESETS[args.preset][2], "comparisons": comparisons,
           "profiles": profiles}
    for suffix, body in ((".json", json.dumps(doc, indent=1)), (".txt", text)):
        tmp = stem.with_suffix(suffix + ".tmp")
        tmp.write_text(body + "\n", encoding="utf-8")
        tmp.replace(stem.with_suffix(suffix))
    print(f"wrote {stem}.json and .txt", flush=True)


# path name -> (FSDP, environment): "fsdp-dtensor" is the FSDP path with its optimizer step and clipping on the
# DTensors (plyx-dist 1.2 and before), "fsdp" the current one (on their local tensors at one rank)
PATHS: dict[str, tuple[bool, dict[str, str]]] = {
    "plain": (False, {}), "fsdp": (True, {}), "fsdp-dtensor": (True, {"PLYX_DIST_LOCAL_WS1": "0"}),
}


def timed_run(args: argparse.Namespace, work: Path, data: Path, name: str, *, fsdp: bool, cuda: bool,
              rep: int) -> dict[str, Any]:
    """One ``plyx train`` run of a path: its last window's tokens/s, its host time per step, its kernels."""
    tag = f"{name}-{rep}"
    cfg = config(args.preset, work / tag, data, fsdp=fsdp, cuda=cuda, batch=args.batch, steps=args.steps)
    trace, clock = work / f"kernels-{tag}.json", work / f"clock-{tag}.json"
    warm = cfg["log_every"] if cfg["steps"] > cfg["log_every"] else 1  # the first log window is the warm-up
    # async_stats: the step CUDA takes (loss and norm read a step late) on CPU too, in both paths; the clock
    # stamps the steps after the first log window (the warm-up)
    m = _runs.train(cfg, work / f"cfg-{tag}", nproc=None, one_rank=fsdp, peak_flops=args.peak_flops,
                    kernels=trace, async_stats=True, clock=(clock, warm), extra_env=PATHS[name][1])
    kernels = json.loads(trace.read_text(encoding="utf-8"))
    host = _step_profile.clock_per_step(json.loads(clock.read_text(encoding="utf-8")))
    tokens_per_step = cfg["batch_size"] * cfg["data"]["seq_len"]
    row = {"bench": "fsdp_ws1_vs_plain", "path": name, "preset": args.preset,
           "tokens_per_s": m["tokens_per_s"], "mfu": m.get("mfu"), "peak_mem_mb": m.get("peak_mem_mb"),
           # the same window as tokens_per_s (metrics.csv's ms_per_step is one step's host time)
           "ms_per_step": 1e3 * tokens_per_step / m["tokens_per_s"],
           # the process's CPU time per step after the warm-up: what the host spends, whatever else runs
           "cpu_ms_per_step": host["cpu_ms_per_step"], "batch": cfg["batch_size"],
           "seq_len": cfg["data"]["seq_len"], "precision": cfg["precision"], "steps": cfg["steps"],
           "kernels": {f"{k['kernel']}[{k['dtype']}]": k["impl"] for k in kernels},
           "dtensor_args": sorted({k["kernel"] for k in kernels if "DTensor" in k["tensor_types"]}),
           "device": _runs.device_name(), "date": _runs.now()}
    mfu = f"{m['mfu']:.4f}" if m.get("mfu") is not None else "-"
    print(f"{name:>6}: {m['tokens_per_s']:>12,.0f} tok/s  {row['ms_per_step']:.1f} ms/step  host CPU "
          f"{row['cpu_ms_per_step']:.1f} ms/step  mfu {mfu}  peak {m.get('peak_mem_mb', 0):,.0f} MB", flush=True)
    if rep == 0:
        print("        kernels: " + ", ".join(f"{k}={v}" for k, v in row["kernels"].items()), flush=True)
    if row["dtensor_args"]:
        print(f"        DTensor arguments reached: {', '.join(row['dtensor_args'])}", flush=True)
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s, its CPU time per step the median of all (with the repeats' values)."""
    if len(rows) == 1:
        return rows[0]
    by_tps = sorted(rows, key=lambda r: r["tokens_per_s"])
    row = dict(by_tps[len(rows) // 2])
    cpu = sorted(r["cpu_ms_per_step"] for r in rows)
    row["cpu_ms_per_step"] = cpu[len(cpu) // 2]
    row["repeats"] = {"tokens_per_s": [r["tokens_per_s"] for r in rows],
                      "cpu_ms_per_step": [r["cpu_ms_per_step"] for r in rows]}
    return row


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "tiny")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (known GPUs are looked up)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's; lower on OOM)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    p.add_argument("--out", default=str(_runs.RESULTS / "fsdp_ws1_vs_plain.jsonl"))
    p.add_argument("--data", default=None, help="prepared shards (default: the bundled Tiny Shakespeare, prepared "
                                                "in a temporary directory)")
    p.add_argument("--before", action="store_true",
                   help="also run the FSDP path as plyx-dist 1.2 had it (optimizer and clipping on DTensors)")
    p.add_argument("--repeat", type=int, default=1, help="runs per path, alternated; rows carry the medians")
    p.add_argument("--profile", action="store_true", help="then profile a few steps of each path (torch.profiler)")
    p.add_argument("--profile-warmup", type=int, default=4, help="steps before the profiled ones")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps profiled per path (default: 3 on CUDA, 10 on CPU, where timings are noisier)")
    p.add_argument("--profile-dir", default=str(_runs.RESULTS), help="where the comparison is written")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="plyx-fsdp-ws1-") as tmp:
        work = Path(tmp)
        data = Path(args.data) if args.data else _runs.prepare_data(work)
        names = ["plain", "fsdp"] + (["fsdp-dtensor"] if args.before else [])
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rep in range(args.repeat):  # alternated, so a load change on a shared machine hits every path alike
            for name in names:
                runs[name].append(timed_run(args, work, data, name, fsdp=PATHS[name][0], cuda=cuda, rep=rep))
        rows = [median_row(runs[name]) for name in names]
        for row in rows:
            row["fsdp_overhead"] = 1 - row["tokens_per_s"] / rows[0]["tokens_per_s"]
            row["fsdp_cpu_overhead"] = row["cpu_ms_per_step"] / rows[0]["cpu_ms_per_step"] - 1
        for row in rows[1:]:
            print(f"{row['path']} at world size 1 costs {row['fsdp_overhead']:+.1%} tokens/s against the plain path, "
                  f"{row['fsdp_cpu_overhead']:+.1%} host CPU time per step ({_runs.device_name()}"
                  f"{f', median of {args.repeat}' if args.repeat > 1 else ''})")
        _runs.append(Path(args.out), rows)
        print(f"wrote {len(rows)} rows to {args.out}")
        if args.profile:
            profile_paths(args, work, data, cuda)


if __name__ == "__main__":
    main()
