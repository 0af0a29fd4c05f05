"""Sweep the grouped GEMM's tiles and weight-gradient variants on the MoE shapes, against dense cuBLAS GEMMs.

The MoE layer runs three grouped GEMMs per projection (gate/up, down): forward, input gradient, weight
gradient. This times each pass alone for every candidate, checks each candidate's output against the
per-expert loop (a wrong variant is reported and never chosen), and prints per pass the candidate with the
least time over both projections, as a fraction of a dense cuBLAS GEMM doing the same FLOPs
(``[rows, K] @ [K, N]``). The weight gradient's candidates are ``WgradTile``s: tiles in the expert-major
order, the first kernel's order (experts fastest), persistent programs, token splits meeting through
float32 atomics, and TMA-descriptor loads.

``--write-table`` stores the winners as this device's entry of
``plyx/kernel/triton_ops/grouped_gemm_tiles.json``, which ``pick_blocks`` (forward, input gradient) and
``pick_weight_grad`` read for many rows per expert; a copy goes to ``--out`` with the results.

Routing is uniform random top-k over the experts (as a trained router's load is roughly balanced), so
each expert gets about ``tokens * top_k / experts`` rows.

Usage::

    python packages/kernel/bench/sweep_grouped_gemm.py --write-table --out DIR   # CUDA: OLMoE-1B-7B layer, bf16
    python packages/kernel/bench/sweep_grouped_gemm.py --tiny --out DIR          # CPU proof (interpreter)

Results: ``<out>/sweep-grouped-gemm-<device>-<date>.jsonl`` (one record per candidate, written as it is
timed) and ``.txt`` (the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
OLMOE = dict(d_model=2048, d_expert=1024, experts=64, top_k=8, tokens=4096)
TINY = dict(d_model=64, d_expert=40, experts=4, top_k=2, tokens=32)

#: forward / input-gradient tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the ones within 5% of
#: the best in the 2026-11-24 H100 sweep (results/sweep-grouped-gemm-cuda-2026-11-24.jsonl), plus 64-row tiles
CUDA_TILES = [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3),
              (128, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 4)]
#: the same tiles with x and W through TMA descriptors (a sixth element, True)
CUDA_TILES += [(*t, True) for t in [(128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 3),
                                    (128, 128, 128, 8, 3)]]
#: weight-gradient dW tiles (rows per step, BLOCK_N, BLOCK_K, warps, stages); 128 x 256 accumulators need 8 warps
WGRAD_TILES = [(64, 256, 64, 4, 4), (64, 256, 64, 8, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 4),
               (64, 128, 256, 8, 3), (64, 128, 256, 8, 4), (64, 256, 128, 8, 3), (64, 256, 128, 8, 4),
               (128, 128, 128, 8, 3), (32, 128, 256, 8, 4)]


def _wgrad_candidates(tiny: bool) -> list[Any]:
    from plyx.kernel.triton_ops.grouped_gemm import WgradTile

    if tiny:  # every variant once at the interpreter's tile
        return [WgradTile(16, 32, 32, 4, 1, s, split, tma) for s, split, tma in
                [("tile", 1, False), ("expert", 1, False), ("persistent", 1, False), ("expert", 2, False),
                 ("expert", 1, True), ("persistent", 2, True), ("persistent-flat", 1, True)]]
    out = [WgradTile(*WGRAD_TILES[0], "tile")]  # the first kernel: its best tile, experts fastest
    out += [WgradTile(*t, "expert") for t in WGRAD_TILES]
    big = [(64, 128, 256, 8, 4), (64, 256, 128, 8, 4), (64, 128, 128, 4, 3)]
    out += [WgradTile(*t, "persistent") for t in big]
    out += [WgradTile(*t, "expert", 1, True) for t in big + [(64, 256, 64, 4, 4)]]
    out += [WgradTile(*big[0], "persistent", 1, True), WgradTile(*big[0], "expert", 2),
            WgradTile(64, 128, 128, 8, 4, "expert", 4)]
    # last: the loop fusion is the likeliest to fail to compile (a crash keeps the records before it;
    # --table-from then finishes the table)
    out += [WgradTile(*big[0], "persistent-flat", 1, tma) for tma in (False, True)]
    return out


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=40, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def _offsets(tokens: int, top_k: int, experts: int, device: torch.device) -> torch.Tensor:
    """Row offsets of each expert's block after a uniform random top-k routing (sorted by expert)."""
    gen = torch.Generator().manual_seed(0)
    choice = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(device)


def _loop_reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> dict[str, Any]:
    """Each pass's output by the per-expert loop, in float32 (the correctness check of every candidate)."""
    bounds = offsets.tolist()
    y, dx, dw = [], [], []
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        xe, dye, we = x[a:b].float(), dy[a:b].float(), w[e].float()
        y.append(xe @ we.T)
        dx.append(dye @ we)
        dw.append(dye.T @ xe)
    return {"forward": torch.cat(y), "input_grad": torch.cat(dx), "weight_grad": torch.stack(dw)}


class _Count:
    """Progress without tqdm (the GPU machine may lack it): a line every 10 candidates."""

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0

    def update(self) -> None:
        self.n += 1
        if self.n % 10 == 0 or self.n == self.total:
            print(f"  {self.n}/{self.total} candidates", flush=True)

    def write(self, line: str) -> None:
        print(line, flush=True)


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Any]:
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Count(total)
        return
    with tqdm(total=total, desc="grouped GEMM sweep", disable=None) as bar:
        yield bar


def _write_json_atomic(path: Path, data: Any) -> None:
    """Indented JSON with each tile on one line, written to a temporary file and renamed over ``path``."""
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]",
                  json.dumps(data, indent=1))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower()


def _summarize(records: list[dict[str, Any]], head: str) -> tuple[str, dict[str, list[Any]]]:
    """The summary lines and, per pass, the candidate with the least time over both projections (timed on both)."""
    dense = {r["gemm"]: r["ms"] for r in records if r["pass_"] == "dense"}
    times: dict[tuple[str, tuple], dict[str, float]] = {}
    defaults: dict[str, tuple] = {}
    for r in records:
        if r["pass_"] == "dense":
            continue
        if r.get("default"):
            defaults[r["pass_"]] = tuple(r["tile"])
        if "ms" in r:
            times.setdefault((r["pass_"], tuple(r["tile"])), {})[r["gemm"]] = r["ms"]
    lines, best = [head], {}
    dense_total = sum(dense.values())
    for pass_name in ("forward", "input_grad", "weight_grad"):
        timed = [(sum(v.values()), tile) for (p, tile), v in times.items() if p == pass_name and len(v) == len(dense)]
        if not timed:
            lines.append(f"{pass_name:12s} no candidate ran")
            continue
        ms, tile = min(timed, key=lambda pair: pair[0])
        best[pass_name] = (ms, tile)
        default = defaults.get(pass_name)
        default_ms = sum(times.get((pass_name, default), {}).values()) or float("nan")
        lines.append(f"{pass_name:12s} dense {dense_total:.3f} ms | default {default} {default_ms:.3f} ms "
                     f"({dense_total / default_ms:.0%} of dense) | best {tile} {ms:.3f} ms ({dense_total / ms:.0%} "
                     "of dense)")
    if len(best) == 3:
        six = sum(ms for ms, _ in best.values())
        lines.append(f"the six GEMMs at the best tiles: {six:.3f} ms, {3 * dense_total / six:.1%} of dense-equivalent "
                     f"({3 * dense_total:.3f} ms)")
    return "\n".join(lines), {p: list(tile) for p, (_, tile) in best.items()}


def _write_table(name: str, measured: str, passes: dict[str, list[Any]], copy: Path) -> None:
    """This device's entry of grouped_gemm_tiles.json (the other devices' entries kept), and a copy in ``copy``."""
    from plyx.kernel.triton_ops import grouped_gemm as gg

    entry = {"measured": measured, "passes": passes}
    table = json.loads(gg.TABLE.read_text()) if gg.TABLE.exists() else {}
    table[name] = entry
    _write_json_atomic(gg.TABLE, table)
    _write_json_atomic(copy, {name: entry})
    print(f"wrote this device's tiles to {gg.TABLE} (and {copy})")


def _sweep(args: argparse.Namespace, stem_of: Callable[[str, str], Path]) -> None:
    from plyx.kernel.triton_ops import grouped_gemm as gg

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = OLMOE if device.type == "cuda" else TINY
    tiles = CUDA_TILES if device.type == "cuda" else [(16, 32, 32, 4, 1), (16, 16, 16, 4, 1), (16, 32, 32, 4, 1, True)]
    wgrad = _wgrad_candidates(device.type != "cuda")
    time_ms = _timer(device)
    d, f, e = shape["d_model"], shape["d_expert"], shape["experts"]
    offsets = _offsets(shape["tokens"], shape["top_k"], e, device)
    rows = int(offsets[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    stamp = dt.date.today().isoformat()
    stem = stem_of(name, stamp)
    head = f"{name}, torch {torch.__version__}, {stamp}: {shape}, {rows} rows, {dtype}"
    print(head)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    smem = gg._shared_memory(device) or 1 << 30

    # (projection, K, N): gate/up reads [rows, d] against [E, 2f, d]; down reads [rows, f] against [E, d, f]
    gemms = {"gate_up": (d, 2 * f), "down": (f, d)}
    defaults = {"forward": gg.pick_blocks(rows, e, device, 2, "forward"),
                "input_grad": gg.pick_blocks(rows, e, device, 2, "input_grad"),
                "weight_grad": gg.pick_weight_grad(rows, e, device, 2)}
    candidates = {"forward": list(dict.fromkeys([defaults["forward"], *tiles])),
                  "input_grad": list(dict.fromkeys([defaults["input_grad"], *tiles])),
                  "weight_grad": list(dict.fromkeys([defaults["weight_grad"], *wgrad]))}
    records: list[dict[str, Any]] = []
    total = sum(len(c) for c in candidates.values()) * len(gemms)
    with stem.with_suffix(".jsonl").open("w") as jsonl, _progress(total) as bar:
        def emit(rec: dict[str, Any]) -> None:  # each record lands on disk at once: a crash keeps what ran
            records.append(rec)
            jsonl.write(json.dumps(rec) + "\n")
            jsonl.flush()

        for gemm, (k, n) in gemms.items():
            x = torch.randn(rows, k, device=device, dtype=dtype)
            w = torch.randn(e, n, k, device=device, dtype=dtype) / k**0.5
            dy = torch.randn(rows, n, device=device, dtype=dtype)
            flops = 2 * rows * n * k
            a = torch.randn(rows, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            dense_ms = time_ms(lambda a=a, b=b: a @ b)
            emit(dict(device=name, date=stamp, gemm=gemm, pass_="dense", tile=[], ms=dense_ms,
                      tflops=flops / dense_ms / 1e9, head=head))
            want = _loop_reference(x, w, dy, offsets)
            runs: dict[str, Callable[[Any], torch.Tensor]] = {
                "forward": lambda t, x=x, w=w, n=n: gg._launch(x, w, (w.stride(0), w.stride(1), w.stride(2)), n,
                                                               offsets, t),
                "input_grad": lambda t, dy=dy, w=w, k=k: gg._launch(dy, w, (w.stride(0), w.stride(2), w.stride(1)),
                                                                    k, offsets, t),
                "weight_grad": lambda t, dy=dy, x=x, w=w: gg._weight_grad(dy, x, offsets, w.shape, w.dtype, t),
            }
            for pass_name, run in runs.items():
                for tile in candidates[pass_name]:
                    bar.update()
                    rec: dict[str, Any] = dict(device=name, date=stamp, gemm=gemm, pass_=pass_name, tile=list(tile),
                                               default=tile == defaults[pass_name])
                    stage = (gg._wgrad_stage_bytes(tile) if pass_name == "weight_grad" else gg._stage_bytes(*tile[:3]))
                    if stage * tile[4] > smem:
                        rec["error"] = "shared memory: stages do not fit"
                    else:
                        try:
                            got = run(tile).float()
                            ref = want[pass_name]
                            rec["rel_err"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                            if not rec["rel_err"] <= tol:
                                rec["error"] = f"wrong result: max error {rec['rel_err']:.1e} > {tol:.0e}"
                            else:
                                ms = time_ms(lambda t=tile, run=run: run(t))
                                rec.update(ms=ms, tflops=flops / ms / 1e9, of_dense=dense_ms / ms)
                        except Exception as exc:  # e.g. a compile failure: reported, the sweep goes on
                            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    if "error" in rec:
                        bar.write(f"  {gemm:8s} {pass_name:12s} {tuple(tile)}: {rec['error']}")
                    emit(rec)
    _finish(records, head, stem, args.write_table and device.type == "cuda",
            f"{stamp}, bench/sweep_grouped_gemm.py, OLMoE layer {shape}, {dtype}, torch {torch.__version__}")


def _finish(records: list[dict[str, Any]], head: str, stem: Path, write_table: bool, measured: str) -> None:
    summary, best = _summarize(records, head)
    print(summary)
    stem.with_suffix(".txt").write_text(summary + "\n")
    print(f"wrote {stem}.txt")
    if write_table:
        if len(best) < 3:
            raise SystemExit(f"not writing the table: passes without a timed candidate ({sorted(best)} ran)")
        name = records[0]["device"]
        _write_table(name, measured, best, stem.with_name(stem.name.replace("sweep-grouped-gemm", "grouped-gemm-tiles")
                                                          + ".json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape in the interpreter (CPU proof)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)),
                        help="results folder (default: $OUT, else bench/results)")
    parser.add_argument("--write-table", action="store_true",
                        help="store the winners as this device's entry of grouped_gemm_tiles.json")
    parser.add_argument("--table-from", type=Path, metavar="JSONL",
                        help="no timing: summarise a sweep's records (e.g. of a run that died part way)")
    args = parser.parse_args()
    if args.tiny or not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is imported (triton.jit reads it)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_from is not None:
        records = [json.loads(line) for line in args.table_from.read_text().splitlines() if line.strip()]
        if not records:
            raise SystemExit(f"{args.table_from} holds no records")
        head = next((r["head"] for r in records if "head" in r), records[0]["device"])
        _finish(records, head, args.out / args.table_from.stem, args.write_table and records[0]["device"] != "cpu",
                f"{records[0]['date']}, bench/sweep_grouped_gemm.py (--table-from {args.table_from.name})")
        return
    _sweep(args, lambda name, stamp: args.out / f"sweep-grouped-gemm-{_slug(name)}-{stamp}")


if __name__ == "__main__":
    main()
