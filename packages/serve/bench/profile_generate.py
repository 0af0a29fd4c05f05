"""Where the host time of ``generate``'s decode loop goes: cProfile of one greedy run, top functions.

    python packages/serve/bench/profile_generate.py --device cuda --config 1.1b --batch 1 --new-tokens 128

With CUDA graphs the GPU work of a step is one replay; what is left on the host (reserving slots,
filling the pinned buffer, sampling, the per-step bookkeeping) is what this shows.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import CONFIGS, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="100m", choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cache", default="paged")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--kernels", action="store_true",
                    help="CUDA: the GPU time of one replayed step, and the kernels of one eager step")
    ap.add_argument("--setup", action="store_true", help="cProfile the host side of one-token generate calls")
    ap.add_argument("--timeline", action="store_true",
                    help="CUDA: where the GPU sits idle during one warm generate call (kernel and copy gaps)")
    args = ap.parse_args()
    from plyx.serve import SamplingParams, generate

    _, model = build(args.config, getattr(torch, args.dtype), args.device)
    prompts = torch.randint(3, CONFIGS[args.config]["vocab_size"], (args.batch, 32)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    graphs = False if args.eager else None

    def generate_with(p: SamplingParams) -> Callable[[], object]:
        return lambda: generate(model, prompts, p, cache=args.cache, cuda_graphs=graphs)

    run = generate_with(params)
    run()  # warm-up: kernels compiled, graphs captured for this batch
    wall = _best_wall(run, args.device, repeats=1)
    print(f"{args.config} batch {args.batch} {args.cache}{' eager' if args.eager else ''}: "
          f"{args.batch * args.new_tokens / wall:.1f} tok/s, {wall / args.new_tokens * 1e3:.3f} ms per step")
    once = generate_with(SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
    once()  # its own spare cache and graphs (another max_seq_len)
    print(f"one-token generate (setup + prefill of {len(prompts[0])} tokens + one sample): "
          f"{_best_wall(once, args.device, repeats=3) * 1e3:.2f} ms")
    if args.setup:  # the host side of a call's start: everything before and around the prefill
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            once()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        prof.disable()
        print("cProfile of 20 one-token generate calls, by cumulative time:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    if args.kernels:
        gpu_breakdown(model, prompts, args.top)
    if args.timeline:
        timeline(run)
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def _best_wall(fn: Callable[[], object], device: str, *, repeats: int) -> float:
    """Best wall-clock seconds of ``fn()`` over ``repeats`` calls, the GPU drained before and after each."""
    cuda = device.startswith("cuda")
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def timeline(run: Callable[[], object]) -> None:
    """Trace one warm call (CPU and CUDA activity) and account for its wall time on the GPU: busy time,
    idle gaps by size (a kernel boundary inside a graph is ~0.5 us; larger ones are the host or a copy),
    and the largest gaps with what ran before and after them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e6
    gpu = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CUDA"), key=lambda t: t[0])
    if not gpu:
        print("timeline: no CUDA activity recorded")
        return
    # merge overlapping activities (programmatic dependent launch overlaps kernels): idle time is what no
    # activity covers
    merged: list[list] = []
    for begin, end, name in gpu:
        if merged and begin <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, name
        else:
            merged.append([begin, end, name, name])  # begin, end, first name, last name
    busy = sum(end - begin for begin, end, _, _ in merged)
    gaps = [(merged[i + 1][0] - merged[i][1], merged[i][3], merged[i + 1][2]) for i in range(len(merged) - 1)]
    span = gpu[-1][1] - gpu[0][0]
    print(f"timeline of one call: wall {wall / 1e3:.2f} ms, GPU span {span / 1e3:.2f} ms, {len(gpu)} GPU activities, "
          f"busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms; first activity at "
          f"+{(gpu[0][0] - _first_cpu(prof)) / 1e3:.2f} ms")
    for low, high in ((0, 2), (2, 10), (10, 50), (50, 1e12)):
        sel = [g for g, _, _ in gaps if low <= g < high]
        print(f"  gaps {low:>3}-{high if high < 1e12 else 'inf':>3} us: {len(sel):5d}, {sum(sel) / 1e3:7.2f} ms")
    by_pair: dict[tuple[str, str], list[float]] = {}
    for g, before, after in gaps:
        if g >= 2:
            by_pair.setdefault((before[:50], after[:50]), []).append(g)
    # per kernel: its mean duration, and the mean time it adds to the busy span (its exposed part: with
    # programmatic dependent launch a kernel starts early and waits, so its duration overstates its cost)
    stats: dict[str, list[float]] = {}
    covered = gpu[0][0]
    for begin, end, name in gpu:
        exposed = max(0.0, end - max(begin, covered))
        covered = max(covered, end)
        entry = stats.setdefault(name[:60], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += end - begin
        entry[2] += exposed
    print("  per activity (count, mean duration us, mean exposed us, total exposed ms):")
    for name, (count, total, exposed) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:14]:
        print(f"    {count:6d} {total / count:8.2f} {exposed / count:8.2f} {exposed / 1e3:8.2f}  {name}")
    print("  gaps of 2 us or more, by the activities around them (count, total ms, mean us):")
    for (before, after), sel in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"    {len(sel):4d} {sum(sel) / 1e3:7.2f} {sum(sel) / len(sel):7.1f}  {before!r} -> {after!r}")


def _first_cpu(prof) -> float:
    cpu = [e.time_range.start for e in prof.events() if e.device_type.name == "CPU"]
    return min(cpu) if cpu else 0.0


def gpu_breakdown(model, prompts, top: int) -> None:
    """Replay one captured step back to back (GPU time alone, no host gaps); list an eager step's kernels."""
    from plyx.attn import make_cache
    from plyx.serve._graphs import DecodeGraphs

    cache = make_cache("paged", model.config, batch_size=len(prompts), max_seq_len=160, device="cuda",
                       dtype=next(model.parameters()).dtype)
    seq_ids = list(range(len(prompts)))
    with torch.inference_mode():
        tokens = model(torch.tensor(prompts, device="cuda"), cache=cache, seq_ids=seq_ids)[:, -1].argmax(-1)
        graphs = DecodeGraphs(model, cache, max_batch=len(prompts))
        graphs.step(seq_ids, tokens)  # captures
        graphs.step(seq_ids, tokens, greedy=True)  # the greedy loop's graph: the same step plus the argmax
        for greedy in (False, True):
            graph, _ = graphs._graphs[(graphs.bucket(len(prompts)), 1, greedy, 1)]  # (bucket, query_len, greedy, steps)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"graph replay{' with the greedy argmax' if greedy else ''}, GPU time per step: "
                  f"{start.elapsed_time(end) / 50 * 1e3:.1f} us")
        from torch.profiler import ProfilerActivity, profile

        graphs.capture = False
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.step(seq_ids, tokens)
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"eager static step: {len(events)} kernels, {sum(e.device_time for e in events):.1f} us of kernel time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top))


if __name__ == "__main__":
    main()
