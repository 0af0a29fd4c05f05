"""The MoE layer, forward and forward+backward: plyx's grouped kernels vs a per-expert loop vs transformers, one run.

Same weights everywhere: transformers' ``OlmoeSparseMoeBlock`` is built from an ``OlmoeConfig`` and
plyx's ``SparseMoE`` loads its state dict (the parameter names are the same), and the outputs are
checked close before timing. Providers:

- ``plyx``: the registry's choice (on CUDA the Triton ``grouped_gemm``, reading the tokens through the
  routing's sorted index with the SwiGLU in its epilogue, and ``moe_unpermute``)
- ``plyx-unfused``: the same kernels composed as before the fusion (``moe_permute``'s copy of the tokens,
  the GEMM, a separate SwiGLU on strided halves, the GEMM, ``moe_unpermute``)
- ``plyx-wgrad-copy``: ``plyx`` with the gate/up weight gradient on a copied grouped x (not gathered)
- ``plyx-loop``: the same block with the references forced (a per-expert ``F.linear`` loop in torch)
- ``hf-eager`` / ``hf-grouped_mm`` / ``hf-batched_mm``: transformers' experts implementations
- ``dense-equivalent``: two cuBLAS matmuls doing the experts' FLOPs as one dense GEMM each (``[N k, D] @
  [D, 2F]``, ``[N k, F] @ [F, D]``): the throughput ceiling the grouped GEMM is compared with

Default shape: one OLMoE-1B-7B layer (D 2048, 64 experts of width 1024, top-8), 4096 tokens, bf16.

The split: a profiled run of ``plyx`` (``profile_moe.py``'s grouping of the kernels) gives the GEMMs'
share of its fwd+bwd and what the rest (routing, permutation, elementwise) costs, in the table and the
results' ``split``.

Usage::

    python packages/model/bench/bench_moe.py                      # CUDA: the OLMoE layer, bf16
    python packages/model/bench/bench_moe.py --tiny               # CPU proof: a tiny layer, float32

Results: ``packages/model/bench/results/moe-<device>-<date>.json`` (and a table on stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
OLMOE = dict(d_model=2048, d_expert=1024, experts=64, top_k=8, tokens=4096)
TINY = dict(d_model=64, d_expert=32, experts=8, top_k=2, tokens=64)


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA (L2 flushed between runs), wall clock elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=max(reps * 10, 50), return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    return wall


def _blocks(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """``(plyx SparseMoE, transformers OlmoeSparseMoeBlock or None)`` with the same weights."""
    from plyx.model import SparseMoE
    from plyx.specs.config import ModelConfig, MoEConfig

    config = ModelConfig(d_model=shape["d_model"], n_heads=16, d_ff=shape["d_expert"],
                         moe=MoEConfig(num_experts=shape["experts"], top_k=shape["top_k"], norm_topk_prob=False))
    ours = SparseMoE(config, device=device, dtype=dtype)
    try:
        import transformers
    except ImportError:  # the GPU machine may lack it: plyx against its own loop and the dense GEMMs only
        torch.manual_seed(0)
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_(0, shape["d_model"] ** -0.5)
        return ours, None
    hf_config = transformers.OlmoeConfig(hidden_size=shape["d_model"], intermediate_size=shape["d_expert"],
                                         num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                                         norm_topk_prob=False, num_attention_heads=16, num_hidden_layers=1)
    torch.manual_seed(0)
    hf = transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, shape["d_model"] ** -0.5)
    hf = hf.to(device=device, dtype=dtype)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours, hf


@contextlib.contextmanager
def _loop_references() -> Any:
    from plyx.kernel import registry

    with registry().override(moe_permute="reference", moe_unpermute="reference", grouped_gemm="reference"):
        yield


def _hf_impl(hf: Any, impl: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        hf.experts.config._experts_implementation = impl
        return hf(x)  # type: ignore[no-any-return]
    return run


def _unfused(ours: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer as composed before the fusion: permuted copy, GEMM, SwiGLU on strided halves, GEMM, combine."""
    from plyx.kernel import grouped_gemm, moe_permute, moe_unpermute, swiglu

    experts = ours.experts

    def run(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        _, weights, ids = ours.route(flat)
        xs, positions, offsets = moe_permute(flat, ids, num_experts=experts.num_experts)
        h = grouped_gemm(xs, experts.gate_up_proj, offsets)  # (N k, 2F)
        f = experts.d_expert
        a = swiglu(h[:, :f], h[:, f:])
        ys = grouped_gemm(a, experts.down_proj, offsets)  # (N k, D)
        return moe_unpermute(ys, positions, weights).view(x.shape)  # type: ignore[no-any-return]
    return run


@contextlib.contextmanager
def _wgrad_copy() -> Any:
    from plyx.kernel.triton_ops import grouped_gemm

    grouped_gemm.GATHER_WEIGHT_GRAD = False
    try:
        yield
    finally:
        grouped_gemm.GATHER_WEIGHT_GRAD = True


def _split(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor, params: list[Any],
           cuda: bool) -> dict[str, Any]:
    """The GEMMs' and the rest's kernel time per fwd+bwd step of ``fn`` (profile_moe's grouping)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from profile_moe import GROUPS, _rows

    xg = x.detach().clone().requires_grad_()

    def step() -> None:
        for p in params:
            p.grad = None
        fn(xg).backward(dy)

    for _ in range(3):
        step()
    steps = 5
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = _rows(prof, cuda, steps)
    groups = {g: sum(r["ms"] for r in rows if r["group"] == g) for g in GROUPS}
    total = sum(groups.values())
    return {"groups_ms": groups, "gemm_ms": groups["gemm"], "rest_ms": total - groups["gemm"], "total_ms": total,
            "rest_share": (total - groups["gemm"]) / total if total else 0.0,
            "top": [{k: r[k] for k in ("name", "group", "ms")} for r in rows[:12]]}


def _dense(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    rows, d, f = shape["tokens"] * shape["top_k"], shape["d_model"], shape["d_expert"]
    w1 = (torch.randn(d, 2 * f, device=device, dtype=dtype) * d ** -0.5).requires_grad_()
    w2 = (torch.randn(f, d, device=device, dtype=dtype) * f ** -0.5).requires_grad_()

    def run(x: torch.Tensor) -> torch.Tensor:
        xs = x.reshape(-1, d).repeat(shape["top_k"], 1)[:rows]  # (N k, D), as many rows as the experts see
        h = xs @ w1
        return (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ w2
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (CPU proof)")
    parser.add_argument("--tokens", type=int, help="tokens per call (default: 4096, tiny 64)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-split", action="store_true", help="skip the profiled GEMM / rest split")
    args, ignored = parser.parse_known_args()  # tools/gpu_run.py passes its extra arguments to every benchmark
    if ignored:
        print(f"ignoring arguments {ignored}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(TINY if args.tiny or device.type != "cuda" else OLMOE)
    if args.tokens:
        shape["tokens"] = args.tokens
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ours, hf = _blocks(shape, dtype, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    today = dt.date.today().isoformat()
    from plyx.kernel import query_for, registry

    w = ours.experts.gate_up_proj
    impls = {k: registry().select(k, query_for(k, w, w)).impl for k in ("moe_permute", "grouped_gemm", "moe_unpermute")}
    print(f"MoE layer on {name} ({device.type}), {today}: {shape}, {dtype}; plyx kernels: {impls}")
    if set(impls.values()) == {"reference"}:
        print("(no Triton here: `plyx` runs the references too, so plyx and plyx-loop time the same code)")

    x = torch.randn(1, shape["tokens"], shape["d_model"], device=device, dtype=dtype)
    with torch.no_grad():
        got = ours(x)
        with _loop_references():
            loop = ours(x)
        if hf is not None:
            hf.experts.config._experts_implementation = "eager"  # transformers' own loop over the experts hit
            want, reference = hf(x), "transformers"
        else:
            want, reference = loop, "the per-expert loop"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    scale = want.abs().max().item()
    errs = {"plyx": (got - want).abs().max().item() / scale, "plyx-loop": (loop - want).abs().max().item() / scale}
    print(f"max error relative to {reference}:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(e < tol for e in errs.values()), f"outputs differ from {reference} beyond {tol}: {errs}"

    providers: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Any]] = {
        "plyx": (ours, contextlib.nullcontext), "plyx-unfused": (_unfused(ours), contextlib.nullcontext)}
    if impls["grouped_gemm"] == "triton":
        providers["plyx-wgrad-copy"] = (ours, _wgrad_copy)
    providers["plyx-loop"] = (ours, _loop_references)
    if hf is not None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        providers["hf-eager"] = (_hf_impl(hf, "eager"), contextlib.nullcontext)
        for impl in ("grouped_mm", "batched_mm"):
            if device.type == "cuda" and impl in ALL_EXPERTS_FUNCTIONS:
                providers[f"hf-{impl}"] = (_hf_impl(hf, impl), contextlib.nullcontext)
    providers["dense-equivalent"] = (_dense(shape, dtype, device), contextlib.nullcontext)
    flops_fwd = 6.0 * shape["tokens"] * shape["top_k"] * shape["d_model"] * shape["d_expert"]
    timer = _timer(device, args.reps)
    params = list(ours.parameters()) + (list(hf.parameters()) if hf is not None else [])
    rows = []
    for label, (fn, ctx) in providers.items():
        xg = x.detach().clone().requires_grad_()
        try:
            with torch.no_grad(), ctx():
                dy = torch.randn_like(fn(x))
        except Exception as exc:  # a provider that cannot run here (e.g. no grouped_mm) is reported, not fatal
            rows += [{"provider": label, "mode": m, "error": f"{type(exc).__name__}: {exc}"[:200]} for m in ("fwd", "fwd+bwd")]
            continue

        def fwd(fn: Callable[[torch.Tensor], torch.Tensor] = fn) -> Any:
            with torch.no_grad():
                return fn(x)

        def fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor] = fn, xg: torch.Tensor = xg,
                    dy: torch.Tensor = dy) -> Any:
            for p in params:
                p.grad = None
            fn(xg).backward(dy)

        for mode, call, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fwd_bwd, 3.0)):
            try:
                with ctx():
                    ms = timer(call)
                rows.append({"provider": label, "mode": mode, "ms": ms, "tflops": flops_fwd * mult / ms / 1e9})
            except Exception as exc:  # a provider that cannot run here is reported, not fatal
                rows.append({"provider": label, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:200]})
    by = {(r["provider"], r["mode"]): r.get("ms") for r in rows}
    for r in rows:
        base = by.get(("plyx", r["mode"]))
        if r.get("ms") and base:
            r["plyx_speedup"] = r["ms"] / base  # > 1: plyx is faster than this provider
    print(f"{'provider':18} {'mode':8} {'ms':>9} {'TFLOP/s':>8} {'plyx x':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['provider']:18} {r['mode']:8} error: {r['error']}")
        else:
            print(f"{r['provider']:18} {r['mode']:8} {r['ms']:9.3f} {r['tflops']:8.2f} {r.get('plyx_speedup', 1):7.2f}")
    summary = {}
    for mode in ("fwd", "fwd+bwd"):
        plyx_ms, loop_ms, dense_ms = by.get(("plyx", mode)), by.get(("plyx-loop", mode)), by.get(("dense-equivalent", mode))
        if plyx_ms and loop_ms and dense_ms:
            summary[mode] = {"x_loop": loop_ms / plyx_ms, "of_dense_throughput": dense_ms / plyx_ms}
            print(f"{mode}: plyx is {loop_ms / plyx_ms:.2f}x the per-expert loop and runs at "
                  f"{100 * dense_ms / plyx_ms:.0f}% of the dense-equivalent GEMMs' throughput")
    split: dict[str, Any] = {}
    if not args.no_split:
        try:
            split = _split(ours, x, torch.randn_like(x), params, device.type == "cuda")
            print(f"split of plyx fwd+bwd (profiled kernel time): GEMMs {split['gemm_ms']:.3f} ms, the rest "
                  f"{split['rest_ms']:.3f} ms ({100 * split['rest_share']:.1f}%): "
                  + ", ".join(f"{g} {ms:.3f}" for g, ms in split["groups_ms"].items()))
            dense_ms = by.get(("dense-equivalent", "fwd+bwd"))
            if dense_ms and split["gemm_ms"]:
                split["gemm_of_dense_throughput"] = dense_ms / split["gemm_ms"]
                print(f"with the rest free, the layer would run at {100 * dense_ms / split['gemm_ms']:.0f}% of the dense-equivalent "
                      "fwd+bwd throughput")
        except Exception as exc:  # the profiler is a diagnostic: its failure never loses the timings
            split = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"split: {split['error']}")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = name.replace(" ", "-").replace("/", "-")
    path = args.out / f"moe-{slug}-{today}.json"
    doc = {"device": name, "device_type": device.type, "date": today, "torch": torch.__version__,
           "dtype": str(dtype).removeprefix("torch."), "shape": shape, "compared_with": reference, "plyx_kernels": impls, "max_rel_error": errs,
           "summary": summary, "split": split, "results": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)  # atomic
    print(f"results: {path}")


if __name__ == "__main__":
    main()
