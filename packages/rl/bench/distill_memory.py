"""Peak memory and time of one distillation loss forward + backward: chunked (fused, checkpoint) vs naive.

    python packages/rl/bench/distill_memory.py                    # CUDA when present (bf16), else CPU (float32)
    python packages/rl/bench/distill_memory.py --tokens 256       # smaller
    python packages/rl/bench/distill_memory.py --chunk 1024       # larger chunks (fewer passes over the weights)

The setup: ``tokens`` positions, a 128k vocabulary (131072, Llama-3's is 128256), student hidden ``d_student``
and teacher hidden ``d_teacher`` wide, the two LM heads; the loss is ``--loss`` (default ``jsd``, the one with
the most per-token work). Modes:

- ``naive``: ``hs @ W_s.T`` and ``ht @ W_t.T`` materialised (``[tokens, V]`` each), the divergence with
  autograd through every op (what ``GKDTrainer`` does).
- ``fused``: ``distill_loss(impl="fused")``, closed-form per-chunk gradients, one pass.
- ``checkpoint``: ``distill_loss(impl="checkpoint")``, per-chunk ``torch.utils.checkpoint``.

Each mode runs in its own process, so one mode's allocator cache never hides another's peak. Peak memory
is what the step adds over its inputs: on CUDA ``max_memory_allocated`` minus the allocated bytes before
the step; on CPU the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident
set before it. Prints the device and the date and appends one JSON line per mode to
``packages/rl/bench/results/distill_memory.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "distill_memory.jsonl"
MODES = ("naive", "fused", "checkpoint")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(args: argparse.Namespace) -> dict:
    """One mode, in this process: returns its row."""
    try:
        from plyx.rl._distill import distill_loss, distill_loss_logits
    except ImportError:  # tools/gpu_run.py installs the GPU planes only: the loss module needs torch alone
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from plyx.rl._distill import distill_loss, distill_loss_logits

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    V = args.vocab
    hs = torch.randn(args.tokens, args.d_student, device=device, dtype=dtype)
    ws = (torch.randn(V, args.d_student, device=device, dtype=dtype) * args.d_student ** -0.5).requires_grad_()
    ht = torch.randn(args.tokens, args.d_teacher, device=device, dtype=dtype)
    wt = torch.randn(V, args.d_teacher, device=device, dtype=dtype) * args.d_teacher ** -0.5
    hs.requires_grad_()
    options = {"loss": args.loss, "beta": 0.5, "top_k": 64}

    def step() -> float:
        if args.mode == "naive":
            zs = (hs @ ws.T).float()  # (N, V)
            with torch.no_grad():
                zt = (ht @ wt.T).float()  # (N, V)
            loss = distill_loss_logits(zs, zt, **options)
        else:
            loss = distill_loss(hs, ws, ht, wt, impl=args.mode, chunk_size=args.chunk or None, **options)
        loss.backward()
        value = float(loss.detach())
        hs.grad = ws.grad = None
        return value

    times, value = [], 0.0
    for i in range(args.warmup + args.repeats):
        _sync(device)
        if i == args.warmup:  # measure the timed steps only (after any lazy initialisation)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            else:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
                base = _rss_kib("VmRSS") * 1024
        t = time.perf_counter()
        value = step()
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_kib("VmHWM") * 1024) - base
    return {"mode": args.mode, "peak_extra_mib": round(peak / 2**20, 1), "ms": round(statistics.median(times) * 1e3, 2),
            "loss_value": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, help="positions (default: 8192 on CUDA, 512 on CPU)")
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--d-student", type=int, help="default: 2048 on CUDA, 256 on CPU")
    parser.add_argument("--d-teacher", type=int, help="default: 4096 on CUDA, 512 on CPU")
    parser.add_argument("--loss", default="jsd", choices=("forward_kl", "reverse_kl", "jsd", "topk"))
    parser.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the default, ~8M logits)")
    parser.add_argument("--chunks", default="", help="comma-separated chunk sizes: the chunked modes once per size "
                        "(e.g. 0,512,2048; overrides --chunk)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--out", type=Path, help="also append the rows to OUT/distill_memory.jsonl (tools/gpu_run.py)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.tokens = args.tokens or (8192 if cuda else 512)
    args.d_student = args.d_student or (2048 if cuda else 256)
    args.d_teacher = args.d_teacher or (4096 if cuda else 512)
    if args.mode:
        print(json.dumps(child(args)))
        return
    device = "cuda" if cuda else "cpu"
    dtype = "bf16" if cuda else "fp32"
    name = torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine())
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"device: {device} ({name}); date: {date}; torch {torch.__version__}; {args.tokens} tokens x vocab "
          f"{args.vocab}; student {args.d_student}, teacher {args.d_teacher} wide; {dtype}; loss {args.loss}; "
          f"one float32 [tokens, V] block = {logits_mib:.0f} MiB")
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()] if args.chunks else [args.chunk]
    runs = [(m, c) for m in args.modes.split(",") for c in (chunks if m != "naive" else [0])]
    for mode, args.chunk in runs:
        cmd = [sys.executable, __file__, "--mode", mode, "--device", device, "--dtype", dtype]
        for key in ("tokens", "vocab", "d_student", "d_teacher", "loss", "chunk", "repeats", "warmup"):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            row = {"mode": mode, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        record = {"bench": "distill_memory", "date": date, "device": f"{device} ({name})", "torch": torch.__version__,
                  "dtype": dtype, "tokens": args.tokens, "vocab": args.vocab, "d_student": args.d_student,
                  "d_teacher": args.d_teacher, "loss": args.loss, "chunk": args.chunk or "default",
                  "logits_block_mib": round(logits_mib, 1), **row}
        print(json.dumps(record))
        targets = ([] if args.no_record else [RESULTS]) + ([args.out / RESULTS.name] if args.out else [])
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
