"""``rmsnorm_linear`` against the unfused path it replaces, timed as a decode step runs it (CUDA graph).

Unfused: plyx's Triton ``rmsnorm`` (+ residual add), ``torch.nn.functional.linear`` (cuBLAS) and, for
the packed MLP, plyx's Triton ``swiglu`` on the two halves. Fused: ``triton_ops.rmsnorm_linear``.
TinyLlama-1.1B shapes (hidden K=2048) at M=1 and M=2 rows, bfloat16:

    qkv      N=2560  (32 q + 2*4 kv heads of 64), with residual
    gate_up  N=11264 (2 x 5632, stacked [gate; up]), SwiGLU, with residual
    lm_head  N=32000, without residual (the final norm)

Each timing is one CUDA graph over ``LAYERS`` distinct weight matrices (one per layer: the weights
stream from HBM as in a real step instead of sitting in L2; one for lm_head), replayed ``REPLAYS``
times between CUDA events, best of ``ROUNDS``, reported per matrix in microseconds with the weight
bandwidth reached (weight bytes / time). The outputs of both paths are compared before timing.

    python packages/kernel/bench/bench_rmsnorm_linear.py [--sweep] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

HIDDEN = 2048  # TinyLlama-1.1B
LAYERS = 22  # TinyLlama-1.1B: one weight matrix per layer in the graph
ROWS = (1, 2)  # decode at batch 1 and 2: the Triton kernel's limit (MAX_ROWS)
DTYPE = torch.bfloat16
EPS = 1e-5
REPLAYS = 20
ROUNDS = 3
#: --sweep: (BLOCK_N, BLOCK_K, num_warps) candidates
SWEEP_N, SWEEP_K, SWEEP_WARPS = (4, 8, 16), (256, 512, 1024, 2048), (4, 8)


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # weight rows (for swiglu: 2 x the output width)
    residual: bool
    swiglu: bool
    count: int  # distinct weight matrices in one graph


SHAPES = (
    Shape("qkv", 2560, residual=True, swiglu=False, count=LAYERS),
    Shape("gate_up", 2 * 5632, residual=True, swiglu=True, count=LAYERS),
    Shape("lm_head", 32000, residual=False, swiglu=False, count=1),
)


def graph_time(fn: Callable[[int], object], count: int, replays: int = REPLAYS) -> float:
    """Microseconds per ``fn(i)``: ``fn(0) ... fn(count - 1)`` captured in one CUDA graph, best of ``ROUNDS``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream (compiles the kernels, cuBLAS workspaces)
        for _ in range(2):
            for i in range(count):
                fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            fn(i)
    graph.replay()  # one untimed replay: first-replay upload costs
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays / count)
    return best


def _inputs(shape: Shape, m: int) -> dict[str, object]:
    """Per-layer weights and norm weights, one activation row set (x, residual) shared by every layer."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device="cuda", generator=g) * scale).to(DTYPE)

    return {"x": rand(m, HIDDEN), "residual": rand(m, HIDDEN) if shape.residual else None,
            "norm": [1.0 + rand(HIDDEN, scale=0.1) for _ in range(shape.count)],
            "weight": [rand(shape.n, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(shape.count)]}


def _fused(shape: Shape, i: dict, blocks: tuple[int, int, int] | None = None) -> Callable[[int], object]:
    from plyx.kernel.triton_ops.rmsnorm_linear import rmsnorm_linear

    def fn(j: int) -> object:
        return rmsnorm_linear(i["x"], i["norm"][j], i["weight"][j], eps=EPS, residual=i["residual"],
                              swiglu=shape.swiglu, blocks=blocks)

    return fn


def _unfused(shape: Shape, i: dict) -> Callable[[int], object]:
    import torch.nn.functional as F
    from plyx.kernel.triton_ops.rmsnorm import rmsnorm
    from plyx.kernel.triton_ops.swiglu import swiglu

    def fn(j: int) -> object:
        if i["residual"] is None:
            n, h = rmsnorm(i["x"], i["norm"][j], eps=EPS), i["x"]
        else:
            n, h = rmsnorm(i["x"], i["norm"][j], eps=EPS, residual=i["residual"])
        y = F.linear(n, i["weight"][j])  # cuBLAS
        if shape.swiglu:
            gate, up = y.chunk(2, dim=-1)  # column views of [M, 2F]: unit stride, as swiglu needs
            y = swiglu(gate, up)
        return y, h

    return fn


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def _check(shape: Shape, i: dict, blocks: tuple[int, int, int] | None = None) -> tuple[float, float]:
    """(y error, h error) of the fused kernel relative to the unfused path, on layer 0."""
    (y1, h1), (y0, h0) = _fused(shape, i, blocks)(0), _unfused(shape, i)(0)
    return _rel_err(y1, y0), _rel_err(h1, h0)


def _sweep(shape: Shape, i: dict) -> tuple[tuple[int, int, int], float]:
    best: tuple[tuple[int, int, int], float] = ((0, 0, 0), float("inf"))
    for bn in SWEEP_N:
        for bk in SWEEP_K:
            for warps in SWEEP_WARPS:
                blocks = (bn, bk, warps)
                try:
                    wrong = _check(shape, i, blocks)[0] > 2e-2  # a config that computes wrongly must not win
                    us = float("inf") if wrong else graph_time(_fused(shape, i, blocks), shape.count)
                except Exception as e:  # e.g. triton's OutOfResources for the widest tiles: skip it
                    print(f"    {blocks}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80]}), skipped")
                    continue
                if wrong:
                    print(f"    {blocks}: wrong output, skipped")
                    continue
                print(f"    {blocks}: {us:8.2f} us")
                if us < best[1]:
                    best = (blocks, us)
    return best


def _header() -> dict[str, str]:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, BLOCK_K, warps) and print the best")
    parser.add_argument("--out", help="append one JSON line per (shape, M) to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to time")
        return 0
    head = _header()
    print(f"rmsnorm_linear vs rmsnorm + F.linear (+ swiglu) | {head['device']} | torch {head['torch']} | {head['date']}")
    print(f"K={HIDDEN} {str(DTYPE).removeprefix('torch.')}, one CUDA graph over the weight matrices, "
          f"{REPLAYS} replays, best of {ROUNDS}; us per matrix")
    print(f"{'shape':>8} {'N':>6} {'M':>2} {'blocks':>14} {'err y':>8} {'unfused':>9} {'fused':>9} {'ratio':>6} "
          f"{'GB/s unf':>9} {'GB/s fus':>9}")
    with torch.inference_mode():  # as decode runs: no autograd bookkeeping in either path
        _run(args, head)
    return 0


def _run(args: argparse.Namespace, head: dict[str, str]) -> None:
    from plyx.kernel.triton_ops.rmsnorm_linear import pick_blocks

    for shape in SHAPES:
        for m in ROWS:
            i = _inputs(shape, m)
            err_y, err_h = _check(shape, i)
            # y: the parity tests' bf16 tolerance (the unfused path rounds the projection before SwiGLU, the kernel
            # does not); h: the same float32 add rounded to bf16 on both paths, so equal up to one bf16 unit
            if err_y > 2e-2 or err_h > 2.0 ** -8:
                print(f"{shape.name} M={m}: fused output differs (y {err_y:.2e}, h {err_h:.2e}); not timed",
                      file=sys.stderr)
                continue
            unfused = graph_time(_unfused(shape, i), shape.count)
            fused = graph_time(_fused(shape, i), shape.count)
            weight_bytes = shape.n * HIDDEN * DTYPE.itemsize
            ratio = unfused / fused
            blocks = pick_blocks(shape.n, HIDDEN)
            print(f"{shape.name:>8} {shape.n:>6} {m:>2} {str(blocks):>14} {err_y:8.1e} {unfused:9.2f} {fused:9.2f} "
                  f"{ratio:6.2f} {weight_bytes / unfused / 1e3:9.0f} {weight_bytes / fused / 1e3:9.0f}")
            row = {**head, "shape": shape.name, "n": shape.n, "k": HIDDEN, "m": m, "dtype": str(DTYPE),
                   "blocks": list(blocks), "unfused_us": unfused, "fused_us": fused, "ratio": ratio, "err_y": err_y,
                   "weight_gbps_unfused": weight_bytes / unfused / 1e3, "weight_gbps_fused": weight_bytes / fused / 1e3}
            if args.sweep:
                best, us = _sweep(shape, i)
                print(f"    best {best}: {us:.2f} us ({unfused / us:.2f}x unfused)")
                row.update(sweep_best=list(best), sweep_best_us=us)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
