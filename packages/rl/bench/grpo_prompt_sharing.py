"""Prompt-KV sharing across a GRPO group: shared vs per-completion prompt, side by side in one run.

    python packages/rl/bench/grpo_prompt_sharing.py                          # CPU, a small model
    python packages/rl/bench/grpo_prompt_sharing.py --device cuda --size 0.5b  # GPU, ~0.5B random weights, bf16

Workload (defaults): one prompt of 1,024 tokens, G = 8 completions of 32 tokens. Three measurements, each
the median of ``--repeats`` timed runs after a warm-up, shared and unshared interleaved:

1. **log-prob pass, forward + backward** (the training step's pass): ``group_token_logps(share_prompt=True)``
   (the prompt once, the completions attending to its cached keys and values with gradients) vs the
   ``[G, P + C]`` batch;
2. **log-prob pass, forward only** (the reference / old-policy log-probs, no graph);
3. **generation** with plyx-serve's engine: one request with ``n = G`` (the prompt prefilled once, its
   paged blocks forked) vs G requests of one completion each with prefix caching off (each prefills the
   prompt), 32 new tokens each (``ignore_eos``).

The work ratio sets the ceiling: tokens through the linear layers ``G (P + C) / (P + G C)`` and attention
``G (P + C)^2 / (P^2 + 2 G C (P + C))`` (6.6x and 5.6x at the defaults); the measured ratio falls below it
by the parts that do not shrink (the completions' own work, the LM head over G C tokens, per-layer gathers
of the prompt's keys for each completion, launch overheads on the GPU).

Appends one JSON line per run to ``packages/rl/bench/results/grpo_prompt_sharing.jsonl`` (device, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_prompt_sharing.jsonl"

#: model shapes: "small" for the CPU, "0.5b" ~ Qwen2.5-0.5B's shape (random weights)
SIZES = {
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192),
    "small": dict(vocab_size=2048, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=704),
    "0.5b": dict(vocab_size=151_936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model shape (default: small on CPU, "
                        "0.5b on CUDA)")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--answer", type=int, default=32, help="completion tokens")
    parser.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-generation", action="store_true", help="skip the engine measurement")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--out", default=str(RESULTS), help="results file (JSON lines, appended)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from plyx.model import TransformerLM
    from plyx.rl._group_logps import group_token_logps
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.specs import ModelConfig

    device = torch.device(args.device)
    size = args.size or ("0.5b" if device.type == "cuda" else "small")
    P, C, G = args.prompt, args.answer, args.group
    shape = SIZES[size]
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", max_seq_len=P + C + 16, tie_embeddings=True, **shape)
    model = TransformerLM(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (P,), generator=g).tolist()
    comps = [torch.randint(0, shape["vocab_size"], (C,), generator=g).tolist() for _ in range(G)]
    name = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    where = f"{device.type} ({name}{'' if cuda else f', {args.threads} thread(s)'})"
    print(f"device: {where}; date: {started}; torch {torch.__version__}; model {size} ({params / 1e6:.1f}M params)")
    print(f"workload: prompt {P}, completions {C}, G = {G}")

    def train_pass(share: bool) -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            logps, mask = group_token_logps(model, prompt, comps, pad=0, share_prompt=share)
        logps.sum().backward()

    def fwd_pass(share: bool) -> None:
        with torch.no_grad(), autocast:
            group_token_logps(model, prompt, comps, pad=0, share_prompt=share)

    results: dict[str, dict[str, float]] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for label, fn in (("logprob_fwd_bwd", train_pass), ("logprob_fwd", fwd_pass)):
        times = {True: [], False: []}
        for share in (True, False):  # warm-up (allocator, kernels' autotuning)
            fn(share)
        for _ in range(args.repeats):
            for share in (True, False):
                times[share].append(_time(lambda fn=fn, share=share: fn(share), device))
        shared, unshared = statistics.median(times[True]), statistics.median(times[False])
        results[label] = {"shared_ms": shared * 1e3, "unshared_ms": unshared * 1e3, "speedup": unshared / shared}
        print(f"{label:16s} shared {shared * 1e3:9.1f} ms   per-completion prompt {unshared * 1e3:9.1f} ms   "
              f"speedup {unshared / shared:.2f}x")
    model.zero_grad(set_to_none=True)

    if not args.no_generation:
        engine_model = model.to(torch.bfloat16 if cuda else torch.float32).eval()
        sp = dict(temperature=1.0, max_new_tokens=C, ignore_eos=True)

        def generate(share: bool) -> None:
            engine = Engine(engine_model, config=EngineConfig(block_size=16, max_model_len=P + C + 16,
                                                              max_batch_size=G, max_batch_tokens=max(2048, P + 64),
                                                              prefix_caching=False), seed=0)
            if share:
                engine.generate([prompt], SamplingParams(n=G, seed=3, **sp))
            else:
                engine.generate([prompt] * G, [SamplingParams(n=1, seed=3 + i, **sp) for i in range(G)])

        times = {True: [], False: []}
        for share in (True, False):
            generate(share)
        for _ in range(args.repeats):
            for share in (True, False):
                times[share].append(_time(lambda share=share: generate(share), device))
        shared, unshared = statistics.median(times[True]), statistics.median(times[False])
        results["generation"] = {"shared_ms": shared * 1e3, "unshared_ms": unshared * 1e3,
                                 "speedup": unshared / shared}
        print(f"{'generation':16s} shared {shared * 1e3:9.1f} ms   per-completion prompt {unshared * 1e3:9.1f} ms   "
              f"speedup {unshared / shared:.2f}x")
    linear = G * (P + C) / (P + G * C)
    attention = G * (P + C) ** 2 / (P ** 2 + 2 * G * C * (P + C))
    print(f"work ratio (ceiling): linear layers {linear:.2f}x, attention {attention:.2f}x")
    record = {"bench": "grpo_prompt_sharing", "date": started, "device": where, "torch": torch.__version__,
              "model": size, "params": params, "prompt": P, "answer": C, "group": G, "repeats": args.repeats,
              "precision": "bf16-autocast" if cuda else "float32", **results,
              "ceiling": {"linear": linear, "attention": attention}}
    if cuda:
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if not args.no_record:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
