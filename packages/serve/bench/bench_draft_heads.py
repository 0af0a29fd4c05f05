"""Draft heads (Medusa, EAGLE) and n-gram speculation against plain greedy decoding: acceptance length and
speedup at each batch size, all in one run, on the same weights and prompts.

Heads on random weights accept nothing, so the script first makes a base that has learnt something and
heads that have learnt it: a small Llama-shaped base trained for ``--base-steps`` on the bundled Tiny
Shakespeare (plyx-train's Trainer), then Medusa heads and an EAGLE draft trained on the frozen base for
``--heads-steps`` each (plyx-train's draft mode, the same code as ``plyx train`` with a ``[draft]``
table). ``--base`` / ``--medusa`` / ``--eagle`` reuse earlier ones. Prompts are held-out windows of the
same corpus (the val split); every method decodes them greedily for exactly ``--new-tokens`` tokens (EOS
ignored) and must emit the base's greedy tokens (checked in float32; in bf16 a k+1-token verify pass
rounds differently from one-token steps, so a near-tie may flip: reported, not fatal).

Acceptance length = tokens emitted per base forward after the prefill (1.0 for plain decoding); speedup =
plain eager greedy time / method time. On CUDA the plain greedy path with CUDA graphs is timed too
(speculation runs eager forwards).

    # CPU proof (minutes):
    python packages/serve/bench/bench_draft_heads.py --size tiny --base-steps 300 --heads-steps 300 \\
        --batch 1,8 --new-tokens 48 --work /tmp/draft-bench
    # GPU (bf16):
    python packages/serve/bench/bench_draft_heads.py --size small --base-steps 2000 --heads-steps 1000 \\
        --batch 1,8 --new-tokens 128 --k 4 --work /tmp/draft-bench

Results: a markdown table printed and written to ``bench/results/draft-heads-<device>-<size>.md``, rows
appended as JSON lines to ``bench/results/draft-heads-<device>.jsonl``.

``--mode engine`` measures the serving engine instead (``plyx.serve.engine.Engine``, what ``plyx serve``
runs): no speculation vs Medusa heads as the engine's proposer with chain verification and with tree
verification (``--tree`` candidates per head), each under ``spec_policy="always"`` (every decode step
speculates) and ``"auto"`` (the per-step rule: speculate only where the measured acceptance length over the
measured verify-step cost beats a plain step), each batch submitted at once and run to completion, same run,
same prompts. The engine keeps its device defaults (on CUDA: decode graphs, multi-step decode and mixed-step
graphs without speculation; with heads, decode-only verification steps replay the verification graphs,
``SpecGraphs``, captured per rows bucket at start-up). Acceptance length = 1 + accepted drafts / row-steps
that verified drafts. Only Medusa heads are trained in this mode (the engine does not run EAGLE drafts).
Results: ``draft-heads-engine-<device>-<size>.md`` and the same JSON lines file with ``"mode": "engine"``.

    # CPU proof (--static: the verification graphs' static step, run eagerly):
    python packages/serve/bench/bench_draft_heads.py --mode engine --size tiny --base-steps 300 \
        --heads-steps 300 --batch 1,8 --new-tokens 48 --static --work /tmp/draft-bench
    # GPU (bf16, about 3 minutes on an H100 with training):
    python packages/serve/bench/bench_draft_heads.py --mode engine --size small --base-steps 2000 \
        --heads-steps 1000 --batch 1,8 --new-tokens 128 --k 4 --tree 3 --work /tmp/draft-bench --out $OUT
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

# base sizes (the data's BPE vocabulary is VOCAB); sizes live here, not in the loop
SIZES = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1408),
    "medium": dict(d_model=1024, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=2816),
}
VOCAB = 2048
SEQ = 256  # training sequence length
PROMPT = 64  # prompt tokens (held-out windows)


def train_base(size: str, steps: int, work: Path, device: str) -> Path:
    """A base trained on the bundled Tiny Shakespeare; returns its checkpoint."""
    from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig
    from plyx.train._trainer import Trainer, TrainOptions

    config = TrainConfig(
        model=ModelConfig(vocab_size=VOCAB, max_seq_len=SEQ + PROMPT + 512, **SIZES[size]),
        data=DataConfig(path="", seq_len=SEQ, vocab_size=VOCAB),
        optimizer=OptimizerConfig(lr=1e-3 if size != "tiny" else 2e-3, weight_decay=0.1, betas=(0.9, 0.95)),
        schedule=ScheduleConfig(warmup_steps=max(1, steps // 20)), steps=steps, batch_size=16,
        precision="bf16-autocast" if device.startswith("cuda") else "float32", device=device,
        out_dir=str(work / f"base-{size}"), log_every=max(1, steps // 10), eval_every=0, checkpoint_every=0,
        sample_tokens=0,
    )
    options = TrainOptions(overwrite=True, progress=False, tensorboard=False, print_fn=print,
                           data_cache=str(work / "data"))
    result = Trainer(config, options=options).fit()
    assert result.checkpoint is not None
    print(f"base: {steps} steps, last loss {result.losses[-1]:.3f} -> {result.checkpoint}")
    return Path(result.checkpoint)


def train_heads(kind: str, base: Path, steps: int, work: Path, device: str, num_heads: int,
                targets: str = "data") -> Path:
    """Heads of ``kind`` trained on the frozen base (plyx-train's draft mode); returns their directory."""
    from plyx.specs import TrainConfig
    from plyx.train._draft import DraftTrainer

    config = TrainConfig.from_dict({
        "data": {"path": "", "seq_len": SEQ, "vocab_size": VOCAB},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": max(1, steps // 20)},
        "steps": steps, "batch_size": 16, "device": device, "out_dir": str(work / f"{kind}-{base.parent.parent.name}"),
        "log_every": max(1, steps // 5), "eval_every": steps, "eval_steps": 4,
        "precision": "bf16-autocast" if device.startswith("cuda") else "float32",
        "draft": {"kind": kind, "base": str(base), "num_heads": num_heads, "targets": targets},
    })
    trainer = DraftTrainer(config, progress=False, tensorboard=False, print_fn=print, data_cache=str(work / "data"))
    result = trainer.fit()
    print(f"{kind}: {steps} steps -> {result.heads}")
    return result.heads


def held_out_prompts(batch: int, work: Path, seed: int) -> list[list[int]]:
    """``batch`` windows of PROMPT tokens from the val split of the prepared corpus."""
    from plyx.specs import DataConfig
    from plyx.train._dataset import TokenDataset
    from plyx.train._datasource import resolve_data_dir
    from plyx.train._shards import ShardSet

    data_dir = resolve_data_dir(DataConfig(path="", seq_len=SEQ, vocab_size=VOCAB), work, cache=str(work / "data"))
    ds = TokenDataset(ShardSet.open(data_dir), "val", seq_len=PROMPT, batch_size=batch, seed=seed)
    return ds.batch(0).input_ids.tolist()


def run(model, prompts, new_tokens: int, cache: str, graphs: bool = False, **spec) -> tuple[float, list]:
    from plyx.serve import SamplingParams, generate

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = generate(model, prompts, params, cache=cache, cuda_graphs=graphs, **spec)
    sync()
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def run_engine(engine, prompts, new_tokens: int) -> tuple[float, list, dict]:
    """One batch through ``engine`` (all requests at once); seconds, completions, speculation counter deltas
    (verification steps run as graphs, ``graph_steps``; decode steps the per-step rule ran plain, ``off``)."""
    from plyx.serve import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    s = engine.stats

    def counters() -> tuple[int, ...]:
        graphs, policy = getattr(engine, "spec_graphs", None), getattr(engine, "spec_policy", None)
        return (s.steps, s.spec_drafted, s.spec_accepted, s.spec_rows, graphs.steps if graphs else 0,
                policy.off_steps if policy else 0)

    before = counters()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    took = time.perf_counter() - start
    delta = dict(zip(("steps", "drafted", "accepted", "rows", "graph_steps", "off"),
                     (a - b for a, b in zip(counters(), before))))
    return took, [o.outputs[0] for o in outs], delta


def engine_mode(args, model, heads, dtype, device_name: str, date: str, train_s: float) -> None:
    """No speculation vs Medusa chain vs Medusa tree in the engine, at each batch size (see the module doc)."""
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.engine._draft_proposer import TokenTree

    batches = [int(b) for b in args.batch.split(",")]
    # the token budget (and so the mixed-step graph buckets captured at start-up) holds a full batch's trees
    tree_nodes = len(TokenTree(min(args.k, heads.num_heads), args.tree))
    budget = max(256, -(-max(batches) * (1 + tree_nodes) // 16) * 16)
    kw: dict[str, Any] = dict(max_batch_size=max(batches), max_batch_tokens=256)
    if args.static:  # CPU: the verification graphs' static step, run eagerly (CUDA captures it by default)
        kw["mixed_graphs"] = True
    tree = f"tree (top-{args.tree})"
    methods = {"engine": (None, EngineConfig(**kw))}
    for policy in ("always", "auto"):  # every step speculates / the per-step rule (SpecPolicy) decides
        methods[f"engine + medusa chain ({policy})"] = (heads, EngineConfig(speculative_k=args.k, spec_policy=policy,
                                                                            **kw))
        methods[f"engine + medusa {tree} ({policy})"] = (heads, EngineConfig(
            speculative_k=args.k, spec_tree=args.tree, spec_policy=policy, **{**kw, "max_batch_tokens": budget}))
    engines = {}
    for name, (h, cfg) in methods.items():
        t0 = time.perf_counter()
        engines[name] = Engine(model, config=cfg, draft_heads=h)  # CUDA: graphs captured here
        print(f"{name}: engine built in {time.perf_counter() - t0:.1f} s")
    lines = [
        f"# engine: no speculation vs Medusa heads (chain, tree): base {args.size} ({model.num_params() / 1e6:.1f}M, "
        f"trained {args.base_steps if not args.base else '?'} steps on Tiny Shakespeare), heads {args.heads_steps} "
        f"steps; {args.device} ({device_name}), {dtype}, torch {torch.__version__}, {date}",
        f"# k={args.k}, tree top-{args.tree} ({tree_nodes} nodes), prompt {PROMPT} held-out tokens, {args.new_tokens} "
        f"new tokens, greedy, best of {args.repeats}; training took {train_s:.0f} s; engine defaults of the device "
        f"(CUDA graphs: {engines['engine'].graphs is not None}, mixed-step graphs: "
        f"{engines['engine'].mixed_graphs is not None}, decode_steps {engines['engine'].decode_steps})",
        "",
        "| method | batch | tok/s | speedup vs engine | acceptance length | drafted / row-step | steps | "
        "verify graph steps | steps without speculation | rows identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rows = []
    for batch in batches:
        prompts = held_out_prompts(batch, work=Path(args.work), seed=batch)
        for engine in engines.values():  # warm-up: kernels, allocator, the first graph replays
            run_engine(engine, prompts, 8)
        times = {name: float("inf") for name in engines}
        outs: dict[str, list] = {}
        deltas: dict[str, dict] = {}
        for _ in range(args.repeats):  # alternate the methods so load drifts hit all
            for name, engine in engines.items():
                t, outs[name], deltas[name] = run_engine(engine, prompts, args.new_tokens)
                times[name] = min(times[name], t)
        ref = [o.token_ids for o in outs["engine"]]
        for name in engines:
            same = sum(o.token_ids == r for o, r in zip(outs[name], ref))
            if same < batch and dtype == torch.float32:
                raise SystemExit(f"{name} changed the greedy tokens of {batch - same} of {batch} float32 rows: a bug")
            d = deltas[name]
            tokens = batch * args.new_tokens
            row = dict(mode="engine", method=name, batch=batch, tok_s=tokens / times[name],
                       speedup=times["engine"] / times[name],
                       acceptance_length=1 + d["accepted"] / d["rows"] if d["rows"] else 1.0,
                       drafted_per_row=d["drafted"] / d["rows"] if d["rows"] else 0.0, steps=d["steps"],
                       verify_graph_steps=d["graph_steps"], steps_off=d["off"],
                       rows_identical=same, tree_nodes=tree_nodes if "tree" in name else None)
            rows.append(row)
            line = (f"| {name} | {batch} | {row['tok_s']:.1f} | {row['speedup']:.2f}x | {row['acceptance_length']:.2f} "
                    f"| {row['drafted_per_row']:.1f} | {d['steps']} | {d['graph_steps']} | {d['off']} "
                    f"| {same}/{batch} |")
            lines.append(line)
            print(line)
    _write(args, "draft-heads-engine", lines, rows, date=date, device=device_name, size=args.size, dtype=str(dtype),
           k=args.k, tree=args.tree, base_steps=args.base_steps, heads_steps=args.heads_steps,
           new_tokens=args.new_tokens)


def _write(args: argparse.Namespace, stem: str, lines: list[str], rows: list[dict], **run: Any) -> None:
    """The table to ``OUT/<stem>-<cuda|cpu>-<size>.md``; each row, with ``run``'s fields, appended to
    ``OUT/draft-heads-<cuda|cpu>.jsonl``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    (out / f"{stem}-{tag}-{args.size}.md").write_text("\n".join(lines) + "\n")
    with open(out / f"draft-heads-{tag}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({**run, **row}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="generate", choices=["generate", "engine"],
                    help="generate: plyx.serve.generate's decoders (Medusa, EAGLE, n-gram); engine: the serving engine")
    ap.add_argument("--tree", type=int, default=3, help="engine mode: candidates per head of the tree (spec_tree)")
    ap.add_argument("--static", action="store_true",
                    help="engine mode: run the verification graphs' static step on CPU too (mixed_graphs=True; "
                    "CUDA captures it by default)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--base", help="a base checkpoint to reuse (default: train one)")
    ap.add_argument("--medusa", help="Medusa heads to reuse (default: train them)")
    ap.add_argument("--eagle", help="an EAGLE draft to reuse (default: train it)")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--heads-steps", type=int, default=300)
    ap.add_argument("--num-heads", type=int, default=4, help="Medusa heads")
    ap.add_argument("--medusa-targets", default="base", choices=["data", "base"],
                    help="Medusa's labels: the corpus (Medusa-1) or the base's own distribution (self-distillation)")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--cache", default="paged", choices=["contiguous", "paged"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings per method")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--work", default="/tmp/plyx-draft-bench", help="where the base, heads and data go")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from plyx.model import load_checkpoint, load_draft_heads

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base_path = Path(args.base) if args.base else train_base(args.size, args.base_steps, work, args.device)
    heads_paths = {
        "medusa": Path(args.medusa) if args.medusa else train_heads("medusa", base_path, args.heads_steps, work,
                                                                    args.device, args.num_heads, args.medusa_targets),
    }
    if args.mode == "generate":  # the engine runs Medusa heads only
        heads_paths["eagle"] = Path(args.eagle) if args.eagle else train_heads("eagle", base_path, args.heads_steps,
                                                                               work, args.device, args.num_heads)
    train_s = time.perf_counter() - t0
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = load_checkpoint(base_path, device=args.device, dtype=dtype).eval()
    heads = {kind: load_draft_heads(p, model, device=args.device) for kind, p in heads_paths.items()}
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.mode == "engine":
        engine_mode(args, model, heads["medusa"], dtype, device_name, date, train_s)
        return
    lines = [
        f"# draft heads vs n-gram vs plain greedy: base {args.size} ({model.num_params() / 1e6:.1f}M, trained "
        f"{args.base_steps if not args.base else '?'} steps on Tiny Shakespeare), heads {args.heads_steps} steps "
        f"(Medusa targets: {args.medusa_targets if not args.medusa else '?'}); "
        f"{args.device} ({device_name}), {dtype}, torch {torch.__version__}, {date}",
        f"# k={args.k}, Medusa heads {heads['medusa'].num_heads}, prompt {PROMPT} held-out tokens, {args.new_tokens} "
        f"new tokens, {args.cache} cache, best of {args.repeats}; training took {train_s:.0f} s",
        "",
        "| method | batch | tok/s | speedup vs greedy | acceptance length | acceptance rate | rows identical |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    methods = {"greedy": {}, "ngram": {"draft_model": "ngram"}, "medusa": {"draft_model": heads["medusa"]},
               "eagle": {"draft_model": heads["eagle"]}}
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = held_out_prompts(batch, work, seed=batch)
        run(model, prompts[:1], 4, args.cache)  # warm-up (allocator, kernels)
        times = {name: float("inf") for name in methods}
        outs: dict[str, list] = {}
        for _ in range(args.repeats):  # alternate the methods so load drifts hit all
            for name, spec in methods.items():
                kw = dict(spec, num_speculative_tokens=args.k) if spec else {}
                t, outs[name] = run(model, prompts, args.new_tokens, args.cache, **kw)
                times[name] = min(times[name], t)
        graphs_t = float("inf")
        if args.device.startswith("cuda"):
            for _ in range(args.repeats):
                graphs_t = min(graphs_t, run(model, prompts, args.new_tokens, args.cache, graphs=True)[0])
        ref = [o.token_ids for o in outs["greedy"]]
        for name in methods:
            same = sum(o.token_ids == r for o, r in zip(outs[name], ref))
            if same < batch and dtype == torch.float32:
                raise SystemExit(f"{name} changed the greedy tokens of {batch - same} of {batch} float32 rows: a bug")
            emitted = sum(o.metrics.num_generated - 1 for o in outs[name])
            forwards = sum(o.metrics.model_steps - 1 for o in outs[name])
            proposed = sum(o.metrics.draft_proposed for o in outs[name])
            accepted = sum(o.metrics.draft_accepted for o in outs[name])
            tokens = batch * args.new_tokens
            row = dict(method=name, batch=batch, tok_s=tokens / times[name], speedup=times["greedy"] / times[name],
                       acceptance_length=emitted / max(forwards, 1),
                       acceptance_rate=accepted / proposed if proposed else None, rows_identical=same,
                       greedy_graphs_tok_s=tokens / graphs_t if graphs_t < float("inf") else None)
            rows.append(row)
            rate = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
            line = (f"| {name} | {batch} | {row['tok_s']:.1f} | {row['speedup']:.2f}x | "
                    f"{row['acceptance_length']:.2f} | {rate} | {same}/{batch} |")
            lines.append(line)
            print(line)
        if graphs_t < float("inf"):
            line = f"| greedy (CUDA graphs) | {batch} | {batch * args.new_tokens / graphs_t:.1f} | " \
                   f"{times['greedy'] / graphs_t:.2f}x | 1.00 | - | - |"
            lines.append(line)
            print(line)
    _write(args, "draft-heads", lines, rows, date=date, device=device_name, size=args.size, dtype=str(dtype),
           k=args.k, base_steps=args.base_steps, heads_steps=args.heads_steps, new_tokens=args.new_tokens,
           cache=args.cache)


if __name__ == "__main__":
    main()
