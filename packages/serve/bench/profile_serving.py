"""Where one serving step's time goes: the engine's decode-only and mixed (prefill chunk + decodes) steps.

Builds the engine over a random Llama-shaped model (``serving.py``'s shapes), fills it with ``--batch``
running requests (prompt ``--input-len`` + a shared ``--prefix-len``), decodes until the batch is in
steady state, then measures:

1. the mean wall time of ``--steps`` decode-only steps and of mixed steps (a new request's prompt chunk
   packed with every decode row), and the share of one step spent on the host before the device waits;
2. ``torch.profiler`` tables of one decode-only and one mixed step (top ops by self device time on CUDA,
   by self CPU time on CPU);
3. ``cProfile`` of the host side of decode-only steps and of ``--mixed-steps`` mixed steps (the Python
   functions the engine runs per step; kernel-registry lookups per mixed step counted).

Mixed steps replay a CUDA graph per token-count bucket (``MixedGraphs``) where the engine captured them
(CUDA, ``--mixed-graphs auto``); ``--mixed-graphs off`` measures the eager packed step, ``on`` on CPU runs
the bucketed static step without capture. ``--model deep`` (the 1.1B's 22 layers at width 64) makes the
per-layer host work dominate on CPU.

    python packages/serve/bench/profile_serving.py                                   # CPU, tiny
    python packages/serve/bench/profile_serving.py --model deep --batch 32 --input-len 32      # CPU, host-bound
    python packages/serve/bench/profile_serving.py --device cuda --model 1.1b --batch 32 --input-len 32

Printed, and written to ``bench/results/profile-serving-<device>-<model>-<date>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import platform
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import MODELS, RESULTS  # (the benchmark's model shapes, one definition)


def build(args: argparse.Namespace) -> Any:
    from plyx.model import TransformerLM, config_from_hf
    from transformers import LlamaConfig

    hc = LlamaConfig(**MODELS[args.model], max_position_embeddings=4096, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with torch.device(args.device):
        model = TransformerLM(config_from_hf(hc.to_dict()))
    return model.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bfloat16 on CUDA")
    p.add_argument("--model", default="tiny", choices=list(MODELS))
    p.add_argument("--batch", type=int, default=8, help="running requests (decode rows)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="decode-only steps timed")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--mixed-steps", type=int, default=10, help="mixed steps timed (median reported)")
    p.add_argument("--mixed-graphs", default="auto", choices=["auto", "on", "off"],
                   help="mixed steps through MixedGraphs: auto = on CUDA with graphs")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="EngineConfig.decode_steps of the profiled engine (0: the device's default); the decode-only "
                        "figures are also measured at 1 (one step per schedule) for comparison")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    model = build(args)
    device = next(model.parameters()).device
    rng = random.Random(0)
    vocab = MODELS[args.model]["vocab_size"]
    prefix = [rng.randrange(8, vocab) for _ in range(args.prefix_len)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(8, vocab) for _ in range(args.input_len)]

    default_k = 8 if device.type == "cuda" else 1
    k_main = args.decode_steps or default_k
    max_len = args.prefix_len + args.input_len + (args.steps + 16) * max(k_main, 1) * 2 + 64

    mixed_graphs = {"auto": None, "on": True, "off": False}[args.mixed_graphs]

    def filled(k: int) -> Any:
        """An engine (``decode_steps=k``) with ``--batch`` requests prefilled and decoding in steady state."""
        multi = {"decode_steps": k} if "decode_steps" in EngineConfig.__struct_fields__ else {}  # (older engines)
        eng = Engine(model, config=EngineConfig(max_batch_size=args.batch + 1, max_batch_tokens=args.max_batch_tokens,
                                                max_model_len=max_len, cuda_graphs=not args.no_graphs,
                                                mixed_graphs=mixed_graphs, **multi))
        params = SamplingParams(temperature=0, max_new_tokens=max_len - args.prefix_len - args.input_len - 1,
                                ignore_eos=True)
        for i in range(args.batch):
            eng.add_request(f"r{i}", prompt(), params)
        while any(s.pending > 1 for s in eng.running) or eng.waiting:  # prefill every prompt
            eng.step()
        for _ in range(3):  # warm: graphs captured, kernels compiled
            eng.step()
        _sync(device)
        return eng

    # time inside the model's forward (eager forwards; a graph replay is not seen). On CPU in thread CPU time, so
    # other processes' turns on a shared machine do not land in either share; on CUDA in wall time.
    now = time.perf_counter if device.type == "cuda" else time.thread_time
    forward_s = [0.0]

    def clock(module: Any, inputs: Any) -> None:
        forward_s.append(now())

    def stop(module: Any, inputs: Any, output: Any) -> None:
        forward_s[0] += now() - forward_s.pop()

    model.register_forward_pre_hook(clock)
    model.register_forward_hook(stop)

    def decode_figures(k: int) -> tuple[float, float, float]:
        """(wall s per decode step, host s per decode step outside the model's forward, tokens/s) of an engine with
        ``decode_steps=k`` over ``--steps * decode_steps`` decode steps (one token per row each: a block of k
        counts k), so every k decodes the same contexts."""
        eng = filled(k)
        steps0, forward_s[0] = eng.stats.steps, 0.0
        eng.stats.multi_step_blocks = getattr(eng.stats, "multi_step_blocks", 0)
        start, start_host = time.perf_counter(), now()
        while eng.stats.steps - steps0 < args.steps * k_main:  # the same tokens (so contexts) at every k
            eng.step()
        _sync(device)
        wall, host = time.perf_counter() - start, now() - start_host
        n = eng.stats.steps - steps0
        return wall / n, (host - forward_s[0]) / n, args.batch * n / wall

    ks = sorted({1, k_main}) if "decode_steps" in EngineConfig.__struct_fields__ else [1]
    figures = {k: decode_figures(k) for k in ks}
    engine = filled(k_main)

    def timed_decode(n: int) -> float:
        start = time.perf_counter()
        steps0 = engine.stats.steps
        for _ in range(n):
            engine.step()
        _sync(device)
        return (time.perf_counter() - start) / max(1, engine.stats.steps - steps0)

    decode_s = timed_decode(args.steps)
    mixed, mixed_cpu = [], []
    for j in range(max(1, args.mixed_steps)):  # a new request's prompt packed with every decode row
        engine.add_request(f"m{j}", prompt(), SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
        _sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        engine.step()
        _sync(device)
        mixed.append(time.perf_counter() - start)
        mixed_cpu.append(time.process_time() - cpu)  # this process's CPU time: other jobs' turns do not count
    prof_mixed = cProfile.Profile()  # the same steps again under cProfile (it slows Python down: not timed)
    for j in range(len(mixed)):
        engine.add_request(f"c{j}", prompt(), SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
        prof_mixed.enable()
        engine.step()
        _sync(device)
        prof_mixed.disable()
    mixed_ms = sorted(mixed)[len(mixed) // 2] * 1e3
    lookups = sum(st[1] for fn, st in pstats.Stats(prof_mixed).stats.items()  # type: ignore[attr-defined]
                  if fn[2] == "get" and fn[0].endswith("_registry.py")) / len(mixed)
    # host share: the time step() takes to return with the device not synchronised by us (look-ahead queued)
    start = time.perf_counter()
    engine.step()
    host_s = time.perf_counter() - start
    _sync(device)

    mg = engine.mixed_graphs
    mixed_path = ("the eager packed step" if mg is None else
                  "MixedGraphs (captured)" if mg.capture else "MixedGraphs (static step, eager)")
    lines = [
        f"# one serving step — {torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'}"
        f", {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        "",
        f"model `{args.model}` ({sum(x.numel() for x in model.parameters()) / 1e6:.1f} M params, {args.dtype}), "
        f"{args.batch} decode rows, prompts {args.prefix_len}+{args.input_len}, packed step {engine.packed}, "
        f"CUDA graphs {engine.graphs is not None}, look-ahead {engine.look_ahead}, "
        f"decode_steps {getattr(engine, 'decode_steps', 1)}",
        "",
        f"decode-only step: {decode_s * 1e3:.2f} ms ({args.batch / decode_s:.0f} tok/s)",
        # on CUDA the host share is the next line's "until step() returns" (a replayed graph hides its forward)
        *(f"decode_steps={k}: {w * 1e3:.3f} ms per decode step ({tps:.0f} tok/s)" + (
            f"; host ms per decode step outside the model's forward: {h * 1e3:.3f} (thread CPU time)"
            if device.type != "cuda" else "") for k, (w, h, tps) in figures.items()),
        f"mixed step (one prompt of {args.prefix_len + args.input_len} tokens + {args.batch} decodes): "
        f"{mixed_ms:.2f} ms (median of {len(mixed)}, best {min(mixed) * 1e3:.2f}) through "
        f"{mixed_path}"
        f", {lookups:.0f} kernel-registry lookups per mixed step; process CPU time per mixed step "
        f"{sorted(mixed_cpu)[len(mixed_cpu) // 2] * 1e3:.2f} ms (median)",
        f"mixed-step graphs: buckets {mg.buckets}, warm-up {mg.warmup_s:.2f} s, replays {mg.replays}" if mg else
        "mixed-step graphs: off",
        f"host time of one decode step (a block of decode_steps), until step() returns: {host_s * 1e3:.2f} ms",

        "",
    ]
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, before in (("decode-only step", None), ("mixed step", "p")):
        if before:
            engine.add_request("p", prompt(), SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
        _sync(device)
        with profile(activities=activities) as prof:
            engine.step()
            _sync(device)
        lines += [f"## torch.profiler: one {name}", "", "```",
                  prof.key_averages().table(sort_by=sort, row_limit=args.top), "```", ""]
    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(5):
        engine.step()
    _sync(device)
    prof_host.disable()
    buf = io.StringIO()
    pstats.Stats(prof_host, stream=buf).sort_stats("tottime").print_stats(args.top)
    lines += ["## cProfile: host side of 5 decode-only steps (by own time)", "", "```", buf.getvalue().strip(), "```", ""]
    # where a mixed step's host time goes, by phase (cumulative, under cProfile: its overhead inflates Python):
    # with graphs, everything but the model forward is what remains on the host
    phases = {"_schedule": "schedule", "prepare": "MixedGraphs.prepare (metadata + copy)",
              "begin_packed_step": "begin_packed_step (metadata + copy)", "forward": "model forward (TransformerLM)",
              "_run": "MixedGraphs._run (forward or replay)", "sample_rows": "sampling", "_accept": "accept tokens",
              "step": "Engine.step (all of it)"}
    table = []
    for (file, _, fn), st in pstats.Stats(prof_mixed).stats.items():  # type: ignore[attr-defined]
        if fn in phases and (fn != "forward" or file.endswith("_model.py") and st[0] == len(mixed)):
            if (fn == "prepare" and not file.endswith("_mixed_graphs.py")) or (fn == "step" and not file.endswith("_engine.py")):
                continue
            table.append(f"  {phases[fn]:<44} {st[3] * 1e3 / len(mixed):8.2f} ms/step  ({st[0] // len(mixed)} calls)")
    lines += [f"## host phases of a mixed step (cumulative ms per step under cProfile, {len(mixed)} steps)", "", "```",
              *sorted(table), "```", ""]
    buf = io.StringIO()
    pstats.Stats(prof_mixed, stream=buf).sort_stats("tottime").print_stats(args.top)
    lines += [f"## cProfile: host side of {len(mixed)} mixed steps (by own time)", "", "```", buf.getvalue().strip(),
              "```"]
    text = "\n".join(lines)
    print(text)
    stem = args.out or f"profile-serving-{device.type}-{args.model}-{dt.date.today().isoformat()}"
    path = RESULTS / (stem if stem.endswith(".txt") else f"{stem}.txt")  # an absolute --out writes there
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
