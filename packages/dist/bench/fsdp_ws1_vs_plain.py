"""FSDP2 at world size 1 against plyx-train's plain single-device path, in one run, same model and batch.

The question (issue 17): what does the FSDP2 code path cost when there is nothing to shard?
Every run is a real ``plyx train`` run on the bundled Tiny Shakespeare, one after the other on the
same device, with ``precision = "bf16-autocast"`` on CUDA (float32 on CPU):

- ``plain``: ``plyx train CONFIG`` (no launcher: the Trainer's own single-device loop); float32
  weights, autocast casts them to bf16 for each matmul, so RMSNorm, RoPE's tables and the residual
  stream stay float32;
- ``fsdp``: ``[dist] strategy = "fsdp"`` with torchrun's variables for one rank (what ``--nproc 1``
  gives the rank it spawns): NCCL process group of one rank, ``fully_shard`` per block + root,
  meta-device init, ``MixedPrecisionPolicy(param_dtype=bf16)``: FSDP's own mixed precision (the
  torchtitan recipe), so the embedding output, the residual stream, RMSNorm and RoPE's tables are bf16;
- ``fsdp-autocast``: the same FSDP2 path with ``param_dtype = "float32"`` under the same autocast as
  ``plain``: the same kernels in the same dtypes as ``plain`` (checked: each row lists the kernel
  implementation and dtype of every kernel call, and a path whose list differs from ``plain``'s is
  named), so its difference is FSDP2's machinery alone. This is the like-for-like comparison;
  ``fsdp`` is the configuration a user runs (and the issue's "bf16 mixed precision");
- ``fsdp-dtensor`` (``--paths``): ``fsdp`` as plyx-dist 1.2 ran it (optimizer step and clipping on
  DTensors, ``PLYX_DIST_LOCAL_WS1=0``).

Timing (``_step_profile.install_clock``): each run takes ``--warmup`` steps first (Triton's autotuning,
the caching allocator's first allocations, cuBLAS's heuristics: all in the first steps), then the clock
synchronises the device, counts ``--steps`` steps and synchronises again: tokens/s is tokens per step x
steps / that wall time, MFU is tokens/s x the model's FLOPs per token (``6 N + 12 L H Dh T``, the
Trainer's) / the device's bf16 dense peak. ``--repeat N`` alternates the paths N times (plain, fsdp,
plain, fsdp, ...: a drift of the machine hits every path alike) and rows carry the medians.
``cpu_ms_per_step`` is the process's CPU time per timed step (on CUDA it includes the host's spinning
waits for the device; on a shared CPU machine it is what other jobs do not inflate).

Presets: ``1b`` (CUDA default) is the 1.0B Llama shape of ``packages/train/bench/mfu.py`` (d 2048,
22 layers, GQA 32/4, FFN 5632, vocab 8192) at seq 2048, batch 8 (16,384 tokens a step: the GPU, not
the host, bounds the step; ``--batch`` lowers it on a smaller GPU); ``gpu`` is the earlier ~1.1B shape at
batch 4 x 1024, where the host bounds the step (kept for comparison with older rows); ``tiny`` proves
the script on CPU (gloo) in seconds.

    python packages/dist/bench/fsdp_ws1_vs_plain.py --repeat 2             # CUDA: 1b, plain/fsdp/fsdp-autocast
    python packages/dist/bench/fsdp_ws1_vs_plain.py --preset tiny          # CPU proof
    python packages/dist/bench/fsdp_ws1_vs_plain.py --profile-only --paths plain,fsdp-autocast  # where it goes

Rows go to ``results/fsdp_ws1_vs_plain.jsonl`` (``--out``); the overhead is ``1 - path / plain`` tokens/s.

``--profile`` (``--profile-only``: without the timed runs): one more short run of each path under
``torch.profiler`` (``_step_profile.py``: ``--profile-steps`` steps after ``--profile-warmup`` steps),
printed side by side: kernel time and launches per step by kind (GEMM, attention, elementwise/copy,
norm, loss, optimizer, collective, memcpy/memset), host time per step, and the kernels and ops that
differ most (device-side ``record_function`` spans excluded: they cover kernels already counted).
The comparison goes to ``<profile-dir>/fsdp_ws1_profile-<device>-<date>-<preset>.{json,txt}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import _runs
import _step_profile


class Preset:
    """A model shape and batch, and the default step counts of a timed run."""

    def __init__(self, model: dict[str, Any], seq: int, batch: int, warmup: int, steps: int) -> None:
        self.model, self.seq, self.batch, self.warmup, self.steps = model, seq, batch, warmup, steps


PRESETS = {
    # the 1.0B Llama of packages/train/bench/mfu.py (its SHAPES["1b"]) at seq 2048, batch 8
    "1b": Preset({"arch": "llama", "d_model": 2048, "n_layers": 22, "n_heads": 32, "n_kv_heads": 4, "d_ff": 5632,
                  "vocab_size": 8192, "max_seq_len": 2048}, 2048, 8, 8, 20),
    # the shape of the rows before 2026-11-25 (host-bound on an H100 at 4 x 1024 tokens)
    "gpu": Preset({"arch": "llama", "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192,
                   "vocab_size": 32768, "max_seq_len": 1024}, 1024, 4, 8, 20),
    "tiny": Preset({"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 192, "vocab_size": 1024, "max_seq_len": 64},
                   64, 4, 5, 15),
}

# path name -> (FSDP, param_dtype on CUDA, environment); on CPU every path runs in float32
PATHS: dict[str, tuple[bool, str | None, dict[str, str]]] = {
    "plain": (False, None, {}),
    "fsdp": (True, "bfloat16", {}),
    "fsdp-autocast": (True, "float32", {}),
    "fsdp-dtensor": (True, "bfloat16", {"PLYX_DIST_LOCAL_WS1": "0"}),
}


def config(preset: str, out: Path, data: Path, *, path: str, cuda: bool, batch: int | None, steps: int) -> dict:
    """The TrainConfig (as a dict) of one run of ``path``: ``steps`` steps, one log line at the end."""
    p = PRESETS[preset]
    fsdp, param_dtype, _ = PATHS[path]
    cfg = {
        "model": {**p.model, "tie_embeddings": False}, "data": {"path": str(data), "seq_len": p.seq},
        "steps": steps, "batch_size": batch or p.batch, "precision": "bf16-autocast" if cuda else "float32",
        "device": "auto", "out_dir": str(out), "log_every": steps, "eval_every": 0, "checkpoint_every": 0,
        "sample_tokens": 0, "schedule": {"warmup_steps": 1},
    }
    if fsdp:
        cfg["dist"] = {"strategy": "fsdp", "param_dtype": param_dtype if cuda else "float32",
                       "reduce_dtype": "float32"}
    return cfg


def profile_paths(args: argparse.Namespace, names: list[str], work: Path, data: Path, cuda: bool) -> None:
    """One short run per path under ``torch.profiler``; each path compared with the first (see the docstring)."""
    start, n = args.profile_warmup, args.profile_steps or (3 if cuda else 10)
    steps = start + n + 2  # step start + n is reported one step late when the loss is read a step late (CUDA)
    profiles: dict[str, Any] = {}
    for name in names:
        cfg = config(args.preset, work / f"prof-{name}", data, path=name, cuda=cuda, batch=args.batch, steps=steps)
        out = work / f"profile-{name}.json"
        _runs.train(cfg, work / f"cfg-prof-{name}", nproc=None, one_rank=PATHS[name][0], peak_flops=args.peak_flops,
                    kernels=work / f"kernels-prof-{name}.json", profile=(out, start, n), async_stats=True,
                    extra_env=PATHS[name][2])
        profiles[name] = json.loads(out.read_text(encoding="utf-8"))
    device, date = _runs.device_name(), _runs.now()
    batch = args.batch or PRESETS[args.preset].batch
    comparisons, texts = {}, []
    for b in names[1:]:
        a = names[0]
        comparisons[f"{a}:{b}"] = cmp = _step_profile.compare(profiles[a], profiles[b])
        texts.append(f"== {b} against {a}: torch.profiler over {n} steps after {start} (preset {args.preset}, "
                     f"batch {batch}, {device}, {date})\n" + _step_profile.format_compare(cmp, (a, b), cuda=cuda))
    text = "\n".join(texts)
    print(text, flush=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    stem = Path(args.profile_dir) / f"fsdp_ws1_profile-{slug}-{date[:10]}-{args.preset}-batch{batch}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": "fsdp_ws1_profile", "preset": args.preset, "device": device, "date": date, "steps": n,
           "warmup": start, "batch": batch, "comparisons": comparisons, "profiles": profiles}
    for suffix, body in ((".json", json.dumps(doc, indent=1)), (".txt", text)):
        tmp = stem.with_suffix(suffix + ".tmp")
        tmp.write_text(body + "\n", encoding="utf-8")
        tmp.replace(stem.with_suffix(suffix))
    print(f"wrote {stem}.json and .txt", flush=True)


def timed_run(args: argparse.Namespace, work: Path, data: Path, name: str, *, cuda: bool, rep: int) -> dict[str, Any]:
    """One ``plyx train`` run of a path: tokens/s and MFU over its timed steps, its CPU time, its kernels."""
    p = PRESETS[args.preset]
    warmup, timed = args.warmup if args.warmup is not None else p.warmup, args.steps or p.steps
    tag = f"{name}-{rep}"
    # the clock's window ends at step warmup + timed, which must not be the last step (reported after the loop
    # when stats are read a step late, a point of the step other than the window's start)
    cfg = config(args.preset, work / tag, data, path=name, cuda=cuda, batch=args.batch, steps=warmup + timed + 1)
    trace, clock = work / f"kernels-{tag}.json", work / f"clock-{tag}.json"
    m = _runs.train(cfg, work / f"cfg-{tag}", nproc=None, one_rank=PATHS[name][0], peak_flops=args.peak_flops,
                    kernels=trace, async_stats=True, clock=(clock, max(warmup, 1), warmup + timed),
                    extra_env=PATHS[name][2])
    kernels = json.loads(trace.read_text(encoding="utf-8"))
    host = _step_profile.clock_per_step(json.loads(clock.read_text(encoding="utf-8")))
    tokens_per_step = cfg["batch_size"] * cfg["data"]["seq_len"]
    tps = 1e3 * tokens_per_step / host["wall_ms_per_step"]
    # the Trainer's MFU is its window's tokens/s x FLOPs per token / peak: the same ratio scales the timed tokens/s
    mfu = tps * m["mfu"] / m["tokens_per_s"] if m.get("mfu") and m.get("tokens_per_s") else None
    row = {"bench": "fsdp_ws1_vs_plain", "path": name, "preset": args.preset, "tokens_per_s": tps, "mfu": mfu,
           "ms_per_step": host["wall_ms_per_step"], "cpu_ms_per_step": host["cpu_ms_per_step"],
           "peak_mem_mb": m.get("peak_mem_mb"), "batch": cfg["batch_size"], "seq_len": cfg["data"]["seq_len"],
           "precision": cfg["precision"], "param_dtype": cfg.get("dist", {}).get("param_dtype"),
           "warmup": warmup, "timed_steps": timed, "timing": "device-synchronised window after the warm-up",
           "kernels": {f"{k['kernel']}[{k['dtype']}]": k["impl"] for k in kernels},
           "dtensor_args": sorted({k["kernel"] for k in kernels if "DTensor" in k["tensor_types"]}),
           "device": _runs.device_name(), "date": _runs.now()}
    mfu_text = f"{mfu:.3f}" if mfu is not None else "-"
    print(f"{name:>14}: {tps:>12,.0f} tok/s  {row['ms_per_step']:.1f} ms/step  host CPU "
          f"{row['cpu_ms_per_step']:.1f} ms/step  mfu {mfu_text}  peak {m.get('peak_mem_mb', 0):,.0f} MB", flush=True)
    if rep == 0:
        print("                kernels: " + ", ".join(f"{k}={v}" for k, v in row["kernels"].items()), flush=True)
    if row["dtensor_args"]:
        print(f"                DTensor arguments reached: {', '.join(row['dtensor_args'])}", flush=True)
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's row with the medians of the runs' figures (and every run's values under ``repeats``)."""
    row = dict(rows[0])
    if len(rows) == 1:
        return row
    keys = ("tokens_per_s", "mfu", "ms_per_step", "cpu_ms_per_step", "peak_mem_mb")
    row["repeats"] = {k: [r[k] for r in rows] for k in keys}
    for k in keys:
        values = [v for v in row["repeats"][k] if v is not None]
        row[k] = statistics.median(values) if values else None
    return row


def kernel_difference(row: dict[str, Any], plain: dict[str, Any]) -> str:
    """How a path's kernel implementations and dtypes differ from the plain path's ('' when they are the same)."""
    a, b = plain["kernels"], row["kernels"]
    only_plain = sorted(f"{k}={v}" for k, v in a.items() if b.get(k) != v)
    only_path = sorted(f"{k}={v}" for k, v in b.items() if a.get(k) != v)
    if not only_plain and not only_path:
        return ""
    return f"plain has {', '.join(only_plain) or 'nothing else'}; {row['path']} has {', '.join(only_path) or 'nothing else'}"


def main() -> None:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b" if cuda else "tiny")
    p.add_argument("--paths", default="plain,fsdp,fsdp-autocast" if cuda else "plain,fsdp",
                   help=f"comma-separated, plain first (of {', '.join(PATHS)})")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (known GPUs are looked up)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's; lower on OOM)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the preset's)")
    p.add_argument("--repeat", type=int, default=1, help="runs per path, alternated; rows carry the medians")
    p.add_argument("--out", default=None, help="JSON lines appended (default: results/fsdp_ws1_vs_plain.jsonl; "
                                               "a directory: that file in it)")
    p.add_argument("--data", default=None, help="prepared shards (default: the bundled Tiny Shakespeare, prepared "
                                                "in a temporary directory)")
    p.add_argument("--profile", action="store_true", help="then profile a few steps of each path (torch.profiler)")
    p.add_argument("--profile-only", action="store_true", help="only the profile, no timed runs")
    p.add_argument("--profile-warmup", type=int, default=6, help="steps before the profiled ones")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="steps profiled per path (default: 3 on CUDA, 10 on CPU, where timings are noisier)")
    p.add_argument("--profile-dir", default=None, help="where the comparison is written (default: beside --out)")
    args = p.parse_args()
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown or not names or names[0] != "plain" or len(set(names)) != len(names):
        p.error(f"--paths {args.paths!r}: give distinct names of {', '.join(PATHS)}, plain first")
    out = Path(args.out) if args.out else _runs.RESULTS / "fsdp_ws1_vs_plain.jsonl"
    if out.is_dir() or (args.out and not out.suffix):
        out = out / "fsdp_ws1_vs_plain.jsonl"
    args.profile_dir = args.profile_dir or str(out.parent)
    with tempfile.TemporaryDirectory(prefix="plyx-fsdp-ws1-") as tmp:
        work = Path(tmp)
        data = Path(args.data) if args.data else _runs.prepare_data(work)
        if not args.profile_only:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for rep in range(args.repeat):  # alternated, so a load change hits every path alike
                for name in names:
                    runs[name].append(timed_run(args, work, data, name, cuda=cuda, rep=rep))
            rows = [median_row(runs[name]) for name in names]
            plain = rows[0]
            for row in rows:
                row["fsdp_overhead"] = 1 - row["tokens_per_s"] / plain["tokens_per_s"]
                row["fsdp_cpu_overhead"] = row["cpu_ms_per_step"] / plain["cpu_ms_per_step"] - 1
                row["kernels_differ"] = kernel_difference(row, plain)
            how = f", median of {args.repeat} alternated runs" if args.repeat > 1 else ""
            print(f"== {rows[0]['device']}, preset {args.preset}, batch {plain['batch']} x {plain['seq_len']}, "
                  f"{plain['timed_steps']} timed steps after {plain['warmup']}{how}")
            for row in rows:
                mfu = f"{row['mfu']:.3f}" if row["mfu"] is not None else "-"
                print(f"{row['path']:>14}: {row['tokens_per_s']:>12,.0f} tok/s  mfu {mfu}  "
                      f"{row['fsdp_overhead']:+.1%} tokens/s cost against plain, {row['fsdp_cpu_overhead']:+.1%} host "
                      f"CPU per step; kernels {'differ: ' + row['kernels_differ'] if row['kernels_differ'] else 'as plain'}")
            _runs.append(out, rows)
            print(f"wrote {len(rows)} rows to {out}")
        if args.profile or args.profile_only:
            profile_paths(args, names, work, data, cuda)


if __name__ == "__main__":
    main()
