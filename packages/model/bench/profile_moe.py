"""Where the MoE layer's time goes: torch.profiler over SparseMoE forward+backward, kernels grouped by role.

Every kernel (CUDA) or leaf op (CPU) the layer's steps launch is put in one group:

- ``gemm``: the grouped GEMMs (forward, input and weight gradients), the router's projection, cuBLAS
- ``permutation``: the sort by expert, the row gathers / scatters (permute, combine with the gate weights)
- ``routing``: softmax, top-k, renormalisation, expert counts and offsets, the row-tile table
- ``elementwise``: SwiGLU and its gradient, casts, fills, adds, reductions
- ``other``: whatever matches none of the above (listed by name, so a misfiled kernel shows)

and the table lists each kernel's time per step, its share of the layer and its group's total: the
split between the GEMMs and the rest is what the 60%-of-dense target turns on.

Default shape: one OLMoE-1B-7B layer (D 2048, 64 experts of width 1024, top-8), 4096 tokens, bf16, on
CUDA; without CUDA a tiny layer in float32 (the references: a per-expert loop).

Usage::

    python packages/model/bench/profile_moe.py --out DIR            # CUDA: the OLMoE layer
    python packages/model/bench/profile_moe.py --tiny --out DIR     # CPU proof

Results: ``DIR/profile-moe-<device>-<date>.txt`` (the table) and ``.json`` (every kernel and group);
``--trace`` adds a Chrome trace.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
OLMOE = dict(d_model=2048, d_expert=1024, experts=64, top_k=8, tokens=4096)
TINY = dict(d_model=64, d_expert=32, experts=8, top_k=2, tokens=64)
GROUPS = ("gemm", "permutation", "routing", "elementwise", "other")

#: (group, pattern) in order, first match wins; matched against the lower-cased kernel or op name
RULES: tuple[tuple[str, str], ...] = (
    ("gemm", r"_grouped_kernel|_weight_grad_kernel|gemm|gemv|cutlass|xmma|nvjet|wgmma|cublas|sm\d+_.*(nn|nt|tn|tt)"
             r"|aten::(mm|addmm|bmm|matmul|linear|_grouped_mm)$"),
    ("routing", r"softmax|topk|bitonic|_tile_kernel|searchsorted|cumsum|scan|histogram|aten::scatter_add"
                r"|logsumexp|aten::sum$|aten::div"),
    ("permutation", r"_routing_kernel|_scatter_kernel|_gather_kernel|_source_rows|sort|radix|index|gather|scatter"
                    r"|aten::cat$"),
    ("elementwise", r"swiglu|silu|sigmoid|elementwise|vectorized|unrolled|copy|fill|aten::(mul|add|to|_to_copy|"
                    r"zero_|zeros|empty|ones|fill_|clone|sub|neg|exp|where|mean|reshape|view|t|transpose|"
                    r"contiguous|arange|clamp|floor_divide|remainder|max|min)|reduce|memset|memcpy"),
)


def classify(name: str) -> str:
    """The group of a kernel or op name (``other`` when no rule matches)."""
    low = name.lower()
    for group, pattern in RULES:
        if re.search(pattern, low):
            return group
    return "other"


def _layer(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Any:
    from plyx.model import SparseMoE
    from plyx.specs.config import ModelConfig, MoEConfig

    config = ModelConfig(d_model=shape["d_model"], n_heads=16, d_ff=shape["d_expert"],
                         moe=MoEConfig(num_experts=shape["experts"], top_k=shape["top_k"], norm_topk_prob=False))
    layer = SparseMoE(config, device=device, dtype=dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, shape["d_model"] ** -0.5)
    return layer.train()


def _rows(prof: Any, cuda: bool, steps: int) -> list[dict[str, Any]]:
    """One row per kernel (CUDA) or per op with self time (CPU): name, group, calls and ms per step."""
    from torch.autograd import DeviceType

    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = float(getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "device_time_total", 0.0))
        else:
            us = float(evt.self_cpu_time_total)
            if evt.key.startswith("ProfilerStep") or evt.key.startswith("fwd+bwd"):
                continue
        if us <= 0:
            continue
        rows.append({"name": evt.key, "group": classify(evt.key), "calls": evt.count / steps,
                     "ms": us / 1e3 / steps})
    total = sum(r["ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["ms"] / total
    return sorted(rows, key=lambda r: -r["ms"])


def _table(rows: list[dict[str, Any]], header: str) -> str:
    groups = {g: sum(r["ms"] for r in rows if r["group"] == g) for g in GROUPS}
    total = sum(groups.values()) or 1.0
    lines = [header, "", f"{'group':12} {'ms/step':>9} {'share':>7}"]
    lines += [f"{g:12} {ms:9.3f} {100 * ms / total:6.1f}%" for g, ms in groups.items()]
    lines += [f"{'total':12} {total:9.3f}", "",
              f"GEMM {groups['gemm']:.3f} ms vs the rest {total - groups['gemm']:.3f} ms "
              f"({100 * (total - groups['gemm']) / total:.1f}% of the layer's kernel time)", "",
              f"{'kernel':80} {'group':12} {'calls':>6} {'ms/step':>9} {'share':>7}"]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 80 else r["name"][:77] + "..."
        lines.append(f"{name:80} {r['group']:12} {r['calls']:6.1f} {r['ms']:9.3f} {100 * r['share']:6.1f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (the CPU proof)")
    parser.add_argument("--tokens", type=int, help="tokens per step (default 4096; tiny 64)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bf16 on CUDA, else float32")
    parser.add_argument("--steps", type=int, default=5, help="profiled fwd+bwd steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args, ignored = parser.parse_known_args()  # tools/gpu_run.py passes its extra arguments to every benchmark
    if ignored:
        print(f"ignoring arguments {ignored}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = dict(TINY if args.tiny or not cuda else OLMOE)
    if args.tokens:
        shape["tokens"] = args.tokens
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    layer = _layer(shape, dtype, device)
    x = torch.randn(1, shape["tokens"], shape["d_model"], device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    today = dt.date.today().isoformat()
    from plyx.kernel import query_for, registry

    w = layer.experts.gate_up_proj
    impls = {k: registry().select(k, query_for(k, w, w)).impl for k in ("moe_permute", "grouped_gemm")}

    def step() -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with torch.profiler.record_function("fwd+bwd"):
            layer(x).backward(dy)

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        wall = start.elapsed_time(end) / args.steps
    else:
        import time

        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = (time.perf_counter() - t0) * 1e3 / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = _rows(prof, cuda, args.steps)
    header = (f"MoE layer fwd+bwd on {name} ({device.type}), {today}, torch {torch.__version__}: {shape}, "
              f"{str(dtype).removeprefix('torch.')}; kernels {impls}\n"
              f"{'kernel' if cuda else 'op self'} time per step, {args.steps} profiled steps; "
              f"the step unprofiled: {wall:.3f} ms")
    text = _table(rows, header)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    stem = args.out / f"profile-moe-{slug}-{today}"
    groups = {g: sum(r["ms"] for r in rows if r["group"] == g) for g in GROUPS}
    doc = {"device": name, "device_type": device.type, "date": today, "torch": torch.__version__,
           "dtype": str(dtype).removeprefix("torch."), "shape": shape, "kernels": impls, "steps": args.steps,
           "step_ms_unprofiled": wall, "groups_ms": groups, "rows": rows}
    for suffix, content in ((".txt", text + "\n"), (".json", json.dumps(doc, indent=1) + "\n")):
        tmp = stem.with_suffix(suffix + ".tmp")
        tmp.write_text(content)
        tmp.replace(stem.with_suffix(suffix))  # atomic
    if args.trace:
        prof.export_chrome_trace(str(stem.with_suffix(".trace.json")))
    print(f"results: {stem}.txt / .json")


if __name__ == "__main__":
    main()
