"""All-reduce bus bandwidth over message sizes, with the nccl-tests formula, on the present backend.

    algbw = S / t                      (bytes of the message over the time of one all-reduce)
    busbw = algbw * 2 (n - 1) / n      (nccl-tests, doc/PERFORMANCE.md: the traffic of a ring
                                        all-reduce per link, comparable across world sizes)

Sizes double from 1 KiB to 1 GiB (``--max-bytes`` lowers the top for CPU runs). NCCL on CUDA,
gloo on CPU, float32 tensors; ``--warmup`` untimed then ``--iters`` timed iterations per size,
the mean time of the slowest rank (an all-reduce ends when its last rank does).

Run (spawns its own ranks)::

    python packages/dist/bench/allreduce_busbw.py --nproc 2 [--max-bytes 64MiB]

or under a launcher (multi-node)::

    torchrun --nproc-per-node 8 packages/dist/bench/allreduce_busbw.py

Rows go to ``results/allreduce_busbw.jsonl`` (one JSON object per size, with device, backend,
world size and date) and a table to stdout (rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"


def _bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def busbw(size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for one all-reduce of ``size_bytes`` taking ``seconds``."""
    alg = size_bytes / seconds / 1e9
    return alg, alg * 2 * (world - 1) / world


def _sizes(low: int, high: int) -> list[int]:
    out, s = [], low
    while s <= high:
        out.append(s)
        s *= 2
    return out


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else f"{platform.processor() or platform.machine()} CPU"
    rows = []
    for size in _sizes(_bytes(args.min_bytes), _bytes(args.max_bytes)):
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(device)
        mine = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        t = float(mine)
        alg, bus = busbw(size, t, world)
        row = {"bench": "allreduce_busbw", "bytes": size, "time_us": t * 1e6, "algbw_GBps": alg, "busbw_GBps": bus,
               "world_size": world, "backend": dist.get_backend(), "device": name,
               "host": socket.gethostname(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        rows.append(row)
        if rank == 0:
            print(f"{size:>12,d} B  {t * 1e6:>11.1f} us  algbw {alg:8.3f} GB/s  busbw {bus:8.3f} GB/s", flush=True)
        del x
    return rows


def _worker(local_rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _main_in_group(args)


def _main_in_group(args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() and not args.gloo else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        rows = run(args)
        if dist.get_rank() == 0:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as fh:
                for row in rows:
                    fh.write(json.dumps(row) + "\n")
            print(f"wrote {len(rows)} rows to {out}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (default 2)")
    p.add_argument("--min-bytes", default="1KiB")
    p.add_argument("--max-bytes", default="1GiB", help="largest message (default 1GiB; e.g. 64MiB on CPU)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--gloo", action="store_true", help="use gloo even when CUDA is present")
    p.add_argument("--out", default=str(RESULTS / "allreduce_busbw.jsonl"))
    args = p.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun
        _main_in_group(args)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
