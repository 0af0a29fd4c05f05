"""Time the MoE layer's fused grouped-GEMM passes against the unfused steps they replace, over a few tiles.

The fused layer (plyx-kernel 1.6) changes three of the six grouped GEMMs; each is timed here alone, on the
OLMoE-1B-7B layer shape with a uniform random top-8 routing, beside the unfused steps it replaces (same
inputs, each checked against a float32 torch computation first) and a dense cuBLAS GEMM of the same FLOPs:

- ``forward_swiglu``: the gate/up forward reading the tokens through the sort's index, SwiGLU in the
  epilogue (training: both halves stored; ``inference``: not) vs the permute copy + GEMM + SwiGLU kernel
- ``input_grad_combine``: the down projection's input gradient reading ``dout`` through the routing, scaled
  by the gate weights, the gate weights' gradient in its epilogue vs ``moe_unpermute``'s backward (the
  rows' gradient and the dot products) + the plain input-gradient GEMM
- ``weight_grad``: both weight gradients on gathered rows (dout's scaled) vs on stored rows

``--write-table`` stores the best tile of the two fused passes in this device's entry of
``grouped_gemm_tiles.json`` (the other passes kept), which the layer then uses.

Usage::

    python packages/kernel/bench/sweep_moe_fused.py --out DIR [--write-table]   # CUDA
    python packages/kernel/bench/sweep_moe_fused.py --tiny --out DIR            # CPU proof (interpreter)

Results: ``DIR/sweep-moe-fused-<device>-<date>.jsonl`` (a record per candidate, written as it is timed)
and ``.txt`` (the summary).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sweep_grouped_gemm import _timer  # this folder is first on sys.path when a script runs

RESULTS = Path(__file__).parent / "results"
OLMOE = dict(d_model=2048, d_expert=1024, experts=64, top_k=8, tokens=4096)
TINY = dict(d_model=48, d_expert=40, experts=4, top_k=2, tokens=24)
#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); for forward_swiglu BLOCK_N is per half (gate and up)
CUDA_TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
              (128, 128, 128, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3)]
TINY_TILES = [(16, 32, 32, 4, 1), (16, 16, 16, 4, 1)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape in the interpreter (CPU proof)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    parser.add_argument("--write-table", action="store_true", help="store the fused passes' best tiles")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are imported
    from plyx.kernel.triton_ops import grouped_gemm as gg
    from plyx.kernel.triton_ops._moe_rows import scatter_rows
    from plyx.kernel.triton_ops.moe_permute import routing_positions
    from plyx.kernel.triton_ops.swiglu import swiglu

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = OLMOE if cuda else TINY
    tiles = CUDA_TILES if cuda else TINY_TILES
    time_ms = _timer(device)  # sweep_grouped_gemm's: do_bench medians on CUDA, a wall clock on CPU
    t, d, f, e, k = (shape[key] for key in ("tokens", "d_model", "d_expert", "experts", "top_k"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices.to(device)
    positions, offsets = routing_positions(ids, e)
    weights = torch.rand(t, k, generator=gen).to(device, dtype)
    rows, row_w = gg.source_rows(positions, weights)
    m = t * k
    x = torch.randn(t, d, device=device, dtype=dtype)
    w1 = torch.randn(e, 2 * f, d, device=device, dtype=dtype) / d ** 0.5
    w2 = torch.randn(e, d, f, device=device, dtype=dtype) / f ** 0.5
    a = torch.randn(m, f, device=device, dtype=dtype)
    dout = torch.randn(t, d, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    stamp = dt.date.today().isoformat()
    head = f"{name}, torch {torch.__version__}, {stamp}: {shape}, {m} rows, {dtype}"
    print(head)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    fwd_tile = gg.pick_blocks(m, e, device, 2, "forward")
    in_tile = gg.pick_blocks(m, e, device, 2, "input_grad")
    s1 = (w1.stride(0), w1.stride(1), w1.stride(2))
    s2t = (w2.stride(0), w2.stride(2), w2.stride(1))  # W2 [E, D, F] read as [E, F, D]

    # torch references (float32 on the grouped rows)
    xs = x.index_select(0, rows.long())  # (M, D)
    h_ref = torch.cat([xs[lo:hi].float() @ w1[i].float().T for i, (lo, hi) in
                       enumerate(zip(offsets.tolist(), offsets.tolist()[1:]))])
    a_ref = torch.nn.functional.silu(h_ref[:, :f]) * h_ref[:, f:]
    p_ref = torch.cat([dout.index_select(0, rows[lo:hi].long()).float() @ w2[i].float() for i, (lo, hi) in
                       enumerate(zip(offsets.tolist(), offsets.tolist()[1:]))])  # (M, F) unscaled
    da_ref = p_ref * row_w[:, None]
    dwt_ref = (p_ref * a.float()).sum(1)

    candidates: dict[str, list[tuple[str, Any, Callable[[], Any], Callable[[Any], float]]]] = {
        "forward_swiglu": [], "inference_swiglu": [], "input_grad_combine": [], "weight_grad": []}
    for tile in tiles:
        candidates["forward_swiglu"].append((
            "fused", tile, lambda tile=tile: gg._launch(x, w1, s1, f, offsets, tile, rows=rows, swiglu=True),
            lambda out: _err(out[1], a_ref)))
        candidates["inference_swiglu"].append((
            "fused", tile,
            lambda tile=tile: gg._launch(x, w1, s1, f, offsets, tile, rows=rows, swiglu=True, store_h=False),
            lambda out: _err(out[1], a_ref)))
        candidates["input_grad_combine"].append((
            "fused", tile, lambda tile=tile: gg._launch(dout, w2, s2t, f, offsets, tile, "input_grad", rows=rows,
                                                        row_scale=row_w, other=a),
            lambda out: max(_err(out[0], da_ref), _err(out[1].sum(1), dwt_ref))))

    def unfused_forward() -> Any:
        xs_copy = scatter_rows(x, positions)[0]
        h = gg._launch(xs_copy, w1, s1, 2 * f, offsets, fwd_tile)
        return h, swiglu(h[:, :f], h[:, f:])

    ys = torch.randn(m, d, device=device, dtype=dtype)

    def unfused_combine_grad() -> Any:
        dys, dwt = scatter_rows(dout, positions, weights, other=ys)
        return gg._launch(dys, w2, s2t, f, offsets, in_tile, "input_grad"), dwt

    for key in ("forward_swiglu", "inference_swiglu"):
        candidates[key].append(("unfused", fwd_tile, unfused_forward, lambda out: _err(out[1], a_ref)))
    candidates["input_grad_combine"].append(("unfused", in_tile, unfused_combine_grad, lambda out: _err(out[0], da_ref)))
    dh = torch.randn(m, 2 * f, device=device, dtype=dtype)
    dys = (dout.index_select(0, rows.long()).float() * row_w[:, None]).to(dtype)
    candidates["weight_grad"] += [
        ("gathered", "gate_up", lambda: gg._weight_grad(dh, x, offsets, w1.shape, dtype, None, rows), None),
        ("stored", "gate_up", lambda: gg._weight_grad(dh, xs, offsets, w1.shape, dtype, None), None),
        ("gathered", "down", lambda: gg._weight_grad(dout, a, offsets, w2.shape, dtype, None, dy_rows=rows,
                                                     dy_scale=row_w), None),
        ("stored", "down", lambda: gg._weight_grad(dys, a, offsets, w2.shape, dtype, None), None)]
    dense = {"gate_up": (torch.randn(m, d, device=device, dtype=dtype), torch.randn(d, 2 * f, device=device, dtype=dtype)),
             "down": (torch.randn(m, f, device=device, dtype=dtype), torch.randn(f, d, device=device, dtype=dtype))}
    dense_ms = {g: time_ms(lambda p=p: p[0] @ p[1]) for g, p in dense.items()}
    records: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower()
    stem = args.out / f"sweep-moe-fused-{slug}-{stamp}"
    with stem.with_suffix(".jsonl").open("w") as jsonl:
        for pass_, cands in candidates.items():
            for kind, tile, run, check in cands:
                rec: dict[str, Any] = dict(device=name, date=stamp, pass_=pass_, kind=kind,
                                           tile=list(tile) if isinstance(tile, tuple) else tile)
                try:
                    out = run()
                    if check is not None:
                        rec["rel_err"] = check(out)
                    if check is not None and not rec["rel_err"] <= tol:
                        rec["error"] = f"wrong result: max error {rec['rel_err']:.1e} > {tol:.0e}"
                    else:
                        rec["ms"] = time_ms(run)
                except Exception as exc:  # a compile failure or shared memory overflow: reported, never chosen
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                records.append(rec)
                jsonl.write(json.dumps(rec) + "\n")
                jsonl.flush()
                print(f"  {pass_:20s} {kind:9s} {str(rec['tile']):28s} "
                      + (f"{rec['ms']:.3f} ms" if "ms" in rec else rec["error"]), flush=True)
    lines = [head, f"dense cuBLAS: gate/up {dense_ms['gate_up']:.3f} ms, down {dense_ms['down']:.3f} ms"]
    best: dict[str, list[Any]] = {}
    for pass_ in candidates:
        timed = [r for r in records if r["pass_"] == pass_ and "ms" in r]
        if pass_ == "weight_grad":
            for g in ("gate_up", "down"):
                by = {r["kind"]: r["ms"] for r in timed if r["tile"] == g}
                lines.append(f"{'weight_grad ' + g:22s} " + ", ".join(f"{kind} {ms:.3f} ms" for kind, ms in by.items())
                             + f" (dense {dense_ms[g]:.3f} ms)")
            continue
        fused = [r for r in timed if r["kind"] == "fused"]
        unfused = next((r["ms"] for r in timed if r["kind"] == "unfused"), float("nan"))
        if not fused:
            lines.append(f"{pass_:22s} no fused candidate ran (unfused {unfused:.3f} ms)")
            continue
        top = min(fused, key=lambda r: r["ms"])
        dense_ref = dense_ms["gate_up" if "swiglu" in pass_ else "down"]
        lines.append(f"{pass_:22s} best fused {tuple(top['tile'])} {top['ms']:.3f} ms | unfused steps {unfused:.3f} ms "
                     f"| dense GEMM {dense_ref:.3f} ms ({dense_ref / top['ms']:.0%} of dense)")
        if pass_ in gg.FUSED_PASSES:
            best[pass_] = top["tile"]
    summary = "\n".join(lines)
    print(summary)
    stem.with_suffix(".txt").write_text(summary + "\n")
    if args.write_table and cuda and best:
        table = json.loads(gg.TABLE.read_text()) if gg.TABLE.exists() else {}
        entry = table.setdefault(name, {"measured": "", "passes": {}})
        entry["passes"].update(best)
        entry["measured"] += f" | fused passes: {stamp}, bench/sweep_moe_fused.py, {shape}, torch {torch.__version__}"
        tmp = gg.TABLE.with_name(gg.TABLE.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        tmp.replace(gg.TABLE)  # atomic
        (args.out / f"grouped-gemm-tiles-{slug}-{stamp}-fused.json").write_text(json.dumps({name: entry}, indent=1) + "\n")
        print(f"wrote the fused passes' tiles {best} to {gg.TABLE}")
    print(f"results: {stem}.txt / .jsonl")


if __name__ == "__main__":
    main()
