"""Prompt-lookup (n-gram) speculation against plain greedy decoding: acceptance length and speedup, one run.

Both sides decode the same prompts greedily for exactly ``--new-tokens`` tokens (EOS ignored) on the same
weights; the tokens must be identical (checked). Two prompt sets, so the figure is not one-sided:

- ``repeat``: a random 16-token passage repeated (documents, code and chat histories repeat themselves;
  the continuation can be copied);
- ``random``: distinct random tokens (nothing to copy from the prompt; drafts come only from loops of the
  output itself).

Both sides run ``plyx.serve.generate``'s eager steps; on CUDA the greedy path with CUDA graphs is timed as well
(``greedy_graphs_tok_s`` in the results).

``--mode engine`` measures the serving engine instead (``plyx.serve.engine.Engine``, device defaults: on CUDA
decode graphs, multi-step decode and mixed-step graphs, and with ``speculative_ngram`` the verification graphs,
``SpecGraphs``): no speculation vs n-gram speculation under ``spec_policy="always"`` and ``"auto"`` (the
per-step rule), each batch submitted at once, same run; tok/s, acceptance length (1 + accepted drafts /
row-steps that verified drafts) and the speedup vs the engine without speculation. Results:
``speculative-ngram-engine-<device>-<config>.md`` and JSON lines with ``"mode": "engine"``.

    # CPU proof (--static: the verification graphs' static step, run eagerly):
    python packages/serve/bench/bench_speculative.py --mode engine --config tiny --batch 1,8 --new-tokens 48 --static
    # GPU (bf16, under a minute on an H100):
    python packages/serve/bench/bench_speculative.py --mode engine --config 100m --batch 1,8 --new-tokens 128 \
        --k 4 --out $OUT

The weights are random (no trained checkpoint is fetched here), so the acceptance measured is that of a
random model's greedy output, which tends to fall into repeating loops; the speedup at a given acceptance
and the overhead of the lookup when nothing matches are what carries over to a trained model.

    python packages/serve/bench/bench_speculative.py --config 100m --batch 1,8 --new-tokens 128 --k 4

Results: printed, and appended as JSON lines to ``bench/results/speculative-ngram-<device>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

# Llama-shaped configurations (random weights); sizes live here, not in the loop
CONFIGS = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=704),
    "100m": dict(vocab_size=32000, d_model=768, n_layers=10, n_heads=12, n_kv_heads=4, d_ff=2048),
    "1.1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),
}
PASSAGE = 16  # tokens of the repeated passage
PROMPT = 64  # prompt tokens


def build(name: str, dtype: torch.dtype, device: str):
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(**CONFIGS[name], max_seq_len=2048, init_std=0.02)
    return TransformerLM(config).to(device=device, dtype=dtype).eval()


def prompts(kind: str, batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        if kind == "repeat":
            passage = torch.randint(3, vocab, (PASSAGE,), generator=g).tolist()
            out.append((passage * (PROMPT // PASSAGE + 1))[:PROMPT])
        else:
            out.append(torch.randperm(vocab - 3, generator=g)[:PROMPT].add(3).tolist())
    return out


def run(model, batch_prompts, new_tokens: int, cache: str, graphs: bool = False, **spec) -> tuple[float, list]:
    from plyx.serve import SamplingParams, generate

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = generate(model, batch_prompts, params, cache=cache, cuda_graphs=graphs or False, **spec)
    sync()
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", default="1,3", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--cache", default="paged", choices=["contiguous", "paged"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings per side")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--mode", default="generate", choices=["generate", "engine"],
                    help="generate: plyx.serve.generate's decoders; engine: the serving engine")
    ap.add_argument("--static", action="store_true",
                    help="engine mode: run the verification graphs' static step on CPU too (mixed_graphs=True)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = build(args.config, dtype, args.device)
    lo, hi = (int(x) for x in args.lookup.split(","))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.mode == "engine":
        engine_mode(args, model, dtype, device_name, date, lo, hi)
        return
    print(f"# n-gram speculation vs greedy: {args.config}, {args.device} ({device_name}), {dtype}, {date}; "
          f"k={args.k}, lookup n in [{lo}, {hi}], {args.new_tokens} new tokens, prompt {PROMPT}")
    print("| prompts | batch | greedy tok/s | n-gram tok/s | speedup | tokens / step | acceptance rate |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for kind in ("repeat", "random"):
        for batch in (int(b) for b in args.batch.split(",")):
            ps = prompts(kind, batch, CONFIGS[args.config]["vocab_size"], seed=batch)
            run(model, ps[:1], 4, args.cache)  # warm-up (allocator, kernels)
            base_t, spec_t = float("inf"), float("inf")
            for _ in range(args.repeats):  # alternate the sides so load drifts hit both
                t, base = run(model, ps, args.new_tokens, args.cache)
                base_t = min(base_t, t)
                t, spec = run(model, ps, args.new_tokens, args.cache, draft_model="ngram", num_speculative_tokens=args.k,
                              prompt_lookup_min=lo, prompt_lookup_max=hi)
                spec_t = min(spec_t, t)
            graphs_t = float("inf")
            if args.device.startswith("cuda"):  # the fastest plain path too: greedy steps replayed as CUDA graphs
                for _ in range(args.repeats):
                    graphs_t = min(graphs_t, run(model, ps, args.new_tokens, args.cache, graphs=True)[0])
            same_rows, agreed = greedy_agreement([o.token_ids for o in base], [o.token_ids for o in spec])
            if same_rows < batch and dtype == torch.float32:
                raise SystemExit(f"n-gram speculation changed the greedy tokens of {batch - same_rows} of {batch} "
                                 "float32 rows: a bug")
            if same_rows < batch:
                # in bf16 a forward over k+1 tokens rounds differently from k+1 one-token steps (other kernels,
                # other reduction orders), so a near-tie of a random model's logits may flip; float32 must agree
                print(f"note: {batch - same_rows} of {batch} {dtype} rows diverge from plain greedy "
                      f"(tokens agreeing before the first divergence: {agreed:.1%}); rerun with --dtype float32 "
                      "to check exactness")
            steps = sum(o.metrics.model_steps for o in spec)
            proposed = sum(o.metrics.draft_proposed for o in spec)
            accepted = sum(o.metrics.draft_accepted for o in spec)
            tokens = batch * args.new_tokens
            row = dict(prompts=kind, batch=batch, rows_identical=same_rows, greedy_prefix_agreement=agreed,
                       greedy_tok_s=tokens / base_t, ngram_tok_s=tokens / spec_t,
                       speedup=base_t / spec_t, tokens_per_step=tokens / steps,
                       acceptance_rate=accepted / proposed if proposed else 0.0, proposed=proposed, accepted=accepted,
                       greedy_graphs_tok_s=tokens / graphs_t if graphs_t < float("inf") else None)
            rows.append(row)
            print(f"| {kind} | {batch} | {row['greedy_tok_s']:.1f} | {row['ngram_tok_s']:.1f} | {row['speedup']:.2f}x "
                  f"| {row['tokens_per_step']:.2f} | {row['acceptance_rate']:.2f} |"
                  + (f" greedy with CUDA graphs: {row['greedy_graphs_tok_s']:.1f} tok/s" if row["greedy_graphs_tok_s"] else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    with open(out / f"speculative-ngram-{tag}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({"date": date, "device": device_name, "config": args.config, "dtype": str(dtype),
                                "k": args.k, "lookup": [lo, hi], "new_tokens": args.new_tokens,
                                "cache": args.cache, **row}) + "\n")


def engine_mode(args: argparse.Namespace, model: Any, dtype: torch.dtype, device_name: str, date: str, lo: int,
                hi: int) -> None:
    """No speculation vs n-gram speculation (every step / the per-step rule) in the engine, per prompt set and
    batch size (see the module doc)."""
    from bench_draft_heads import run_engine
    from plyx.serve.engine import Engine, EngineConfig

    batches = [int(b) for b in args.batch.split(",")]
    kw: dict[str, Any] = dict(max_batch_size=max(batches), max_batch_tokens=256, prompt_lookup_min=lo,
                              prompt_lookup_max=hi)
    if args.static:
        kw["mixed_graphs"] = True
    engines = {"engine": Engine(model, config=EngineConfig(**kw))}
    for policy in ("always", "auto"):
        engines[f"engine + n-gram ({policy})"] = Engine(model, config=EngineConfig(
            speculative_ngram=args.k, spec_policy=policy, **kw))
    plain = engines["engine"]
    lines = [
        f"# engine: no speculation vs n-gram (prompt lookup) speculation: {args.config} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, random weights); {args.device} ({device_name}), "
        f"{dtype}, torch {torch.__version__}, {date}",
        f"# k={args.k}, lookup n in [{lo}, {hi}], prompt {PROMPT} tokens, {args.new_tokens} new tokens, greedy, best "
        f"of {args.repeats}; engine defaults of the device (CUDA graphs: {plain.graphs is not None}, mixed-step "
        f"graphs: {plain.mixed_graphs is not None}, decode_steps {plain.decode_steps}); verification graphs: "
        f"{engines['engine + n-gram (always)'].spec_graphs is not None}",
        "",
        "| prompts | method | batch | tok/s | speedup vs engine | acceptance length | steps | verify graph steps | "
        "steps without speculation | rows identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rows = []
    for kind in ("repeat", "random"):
        for batch in batches:
            ps = prompts(kind, batch, CONFIGS[args.config]["vocab_size"], seed=batch)
            for engine in engines.values():  # warm-up: kernels, allocator, the first replays
                run_engine(engine, ps, 8)
            times = {name: float("inf") for name in engines}
            outs: dict[str, list] = {}
            deltas: dict[str, dict] = {}
            for _ in range(args.repeats):  # alternate the methods so load drifts hit all
                for name, engine in engines.items():
                    t, outs[name], deltas[name] = run_engine(engine, ps, args.new_tokens)
                    times[name] = min(times[name], t)
            ref = [o.token_ids for o in outs["engine"]]
            for name in engines:
                same, agreed = greedy_agreement(ref, [o.token_ids for o in outs[name]])
                if same < batch and dtype == torch.float32:
                    raise SystemExit(f"{name} changed the greedy tokens of {batch - same} of {batch} float32 rows")
                d = deltas[name]
                row = dict(mode="engine", prompts=kind, method=name, batch=batch,
                           tok_s=batch * args.new_tokens / times[name], speedup=times["engine"] / times[name],
                           acceptance_length=1 + d["accepted"] / d["rows"] if d["rows"] else 1.0, steps=d["steps"],
                           verify_graph_steps=d["graph_steps"], steps_off=d["off"], rows_identical=same,
                           greedy_prefix_agreement=agreed)
                rows.append(row)
                line = (f"| {kind} | {name} | {batch} | {row['tok_s']:.1f} | {row['speedup']:.2f}x | "
                        f"{row['acceptance_length']:.2f} | {d['steps']} | {d['graph_steps']} | {d['off']} | "
                        f"{same}/{batch} |")
                lines.append(line)
                print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    (out / f"speculative-ngram-engine-{tag}-{args.config}.md").write_text("\n".join(lines) + "\n")
    with open(out / f"speculative-ngram-{tag}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({"date": date, "device": device_name, "config": args.config, "dtype": str(dtype),
                                "k": args.k, "lookup": [lo, hi], "new_tokens": args.new_tokens, **row}) + "\n")


def greedy_agreement(base: list[list[int]], spec: list[list[int]]) -> tuple[int, float]:
    """Rows of ``spec`` equal to ``base``, and the share of ``base``'s tokens before each row's first divergence."""
    same, prefix, total = 0, 0, 0
    for a, b in zip(base, spec):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n if a != b else len(a)
        total += len(a)
    return same, prefix / max(total, 1)


if __name__ == "__main__":
    main()
