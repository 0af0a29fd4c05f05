"""CPU decoding and int8 report: onnxruntime (fp32, int8-dynamic, int8-static) vs plyx eager vs transformers.

One run, one model, one machine:

1. A small Llama-style model is trained with plyx-train on the first 90 % of Tiny Shakespeare
   (byte-level BPE trained on the same text), unless ``--checkpoint`` names one.
2. It is exported with ``plyx.export.export_onnx(..., with_kv_cache=True)``: float32, then
   ``int8-dynamic`` and ``int8-static`` (calibration: a slice of the training text, tokenised
   by the model's tokenizer). Each export runs the exporter's own verification.
3. For each graph: file size, greedy decode tokens/s at batch 1 through the KV graph
   (onnxruntime CPU), perplexity on the held-out last 10 % of Tiny Shakespeare, and greedy
   agreement with the float32 model over 64 tokens from several prompts.
4. The same decode in plyx eager (``plyx.serve.generate``, temperature 0, contiguous KV cache)
   and in transformers (``generate(do_sample=False)`` on the ``--format hf`` export), same
   prompt, same thread count.

Results: ``bench/results/onnx_cpu.jsonl`` (one JSON line per run) and ``onnx_cpu.md`` (the table).

    python packages/export/bench/onnx_cpu.py                    # ~15 min on 2 shared CPU cores (training included)
    python packages/export/bench/onnx_cpu.py --checkpoint DIR   # reuse a trained checkpoint
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
DATA = Path("/work/shared/data/tinyshakespeare.txt")


def _train(text: Path, work: Path, steps: int) -> Path:
    from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig
    from plyx.train import Trainer, TrainOptions

    config = TrainConfig(
        model=ModelConfig(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256),
        data=DataConfig(path=str(text), seq_len=128, mode="windows", val_fraction=0.05, vocab_size=1024),
        optimizer=OptimizerConfig(lr=3e-3, grad_clip=1.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=min(20, steps // 2)),
        steps=steps, batch_size=16, device="cpu", out_dir=str(work / "run"), log_every=50, eval_every=0,
        checkpoint_every=0, sample_tokens=0,
    )
    result = Trainer(config, options=TrainOptions(progress=True, tensorboard=False)).fit()
    assert result.checkpoint is not None
    return Path(result.checkpoint)


def _ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort
    from plyx.export._verify_kv import KVSession

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return KVSession(path, session_options=options)


def _median_rate(fn: Any, tokens: int, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def _perplexity_ort(kv: Any, windows: list[np.ndarray]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        T = w.shape[1]
        logits, _ = kv.step(w, np.ones((1, T), np.int64), np.arange(T, dtype=np.int64)[None], kv.empty_past(1))
        logp = torch.log_softmax(torch.from_numpy(logits[0, :-1]).double(), -1)  # (T-1, V)
        nll -= float(logp.gather(1, torch.from_numpy(w[0, 1:])[:, None]).sum())
        count += T - 1
    return float(np.exp(nll / count))


def _perplexity_torch(model: Any, windows: list[np.ndarray]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.from_numpy(w)
            logp = torch.log_softmax(model(ids)[0, :-1].double(), -1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return float(np.exp(nll / count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a trained plyx checkpoint (default: train one on Tiny Shakespeare)")
    parser.add_argument("--data", default=str(DATA), help="Tiny Shakespeare text")
    parser.add_argument("--steps", type=int, default=300, help="training steps when no --checkpoint")
    parser.add_argument("--work", help="work directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for every runtime (default 1: on a shared machine, more threads only wait)")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode length of the speed runs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", default=str(HERE / "results"))
    args = parser.parse_args()

    from plyx.export import export, export_onnx
    from plyx.export._verify_kv import greedy_torch
    from plyx.model import load_checkpoint
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="plyx-onnx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    text = Path(args.data).read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    (work / "train.txt").write_text(text[:cut], encoding="utf-8")
    held_out = text[cut:]
    (work / "calibration.txt").write_text(text[:20000], encoding="utf-8")  # from the training split

    started = time.perf_counter()
    checkpoint = Path(args.checkpoint) if args.checkpoint else _train(work / "train.txt", work, args.steps)
    train_s = time.perf_counter() - started
    model = load_checkpoint(checkpoint).eval()
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    held = np.asarray(tok.encode(held_out).ids, dtype=np.int64)
    T = 128
    windows = [held[i:i + T][None] for i in range(0, len(held) - T, max(T, (len(held) - T) // 32))][:32]
    prompt_ids = tok.encode(held_out[:400]).ids[:32]
    prompts = [tok.encode(held_out[i:i + 200]).ids[:16] for i in range(0, 8 * 2000, 2000)]

    graphs: dict[str, Path] = {}
    export_s: dict[str, float] = {}
    for name, options in (("fp32", {}), ("int8-dynamic", {"quantize": "int8-dynamic"}),
                          ("int8-static", {"quantize": "int8-static", "calibration": work / "calibration.txt"})):
        started = time.perf_counter()
        result = export_onnx(model, work / f"onnx-{name}", source=checkpoint, with_kv_cache=True, force=True,
                             hooks=False, **options)
        export_s[name] = time.perf_counter() - started
        graphs[name] = result.model
        print(f"exported {name} in {export_s[name]:.1f} s: {result.model.stat().st_size:,} bytes")

    reference = [greedy_torch(model, p, 64)[0] for p in prompts]
    ppl_torch = _perplexity_torch(model, windows)
    rows = []
    for name, path in graphs.items():
        kv = _ort_session(path, args.threads)
        rate = _median_rate(lambda kv=kv: kv.greedy(prompt_ids, args.new_tokens), args.new_tokens, args.reps)
        agreements = []
        for p, want in zip(prompts, reference):
            got = kv.greedy(p, 64)
            agreements.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), 64) / 64)
        rows.append({"runtime": f"onnxruntime {name}", "file_bytes": path.stat().st_size,
                     "tok_s": rate, "perplexity": _perplexity_ort(kv, windows),
                     "greedy_agreement": float(np.mean(agreements)), "greedy_equal": sum(a == 1 for a in agreements),
                     "export_s": export_s[name]})
        print(rows[-1])

    from plyx.serve import SamplingParams, generate

    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rate = _median_rate(lambda: generate(model, [prompt_ids], params, cache="contiguous"), args.new_tokens, args.reps)
    rows.append({"runtime": "plyx eager (plyx.serve.generate, contiguous cache)", "tok_s": rate,
                 "perplexity": ppl_torch})
    import transformers

    hf_dir = work / "hf"
    export(model, hf_dir, format="hf", source=checkpoint, force=True, hooks=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])

    def hf_generate() -> None:
        with torch.no_grad():
            hf.generate(ids, do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        pad_token_id=0)

    rows.append({"runtime": "transformers (generate, DynamicCache)",
                 "tok_s": _median_rate(hf_generate, args.new_tokens, args.reps)})
    print(rows[-2:])

    record = {
        "bench": "onnx_cpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_threads": args.threads, "torch": torch.__version__, "onnxruntime": version("onnxruntime"),
        "transformers": version("transformers"), "plyx_export": version("plyx-export"),
        "model": {**model.config.to_dict(), "params": model.num_params()}, "checkpoint": str(checkpoint),
        "train_steps": None if args.checkpoint else args.steps, "train_s": None if args.checkpoint else train_s,
        "held_out": {"text": "last 10 % of Tiny Shakespeare", "windows": len(windows), "tokens_per_window": T},
        "decode": {"batch": 1, "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens, "reps": args.reps},
        "greedy_agreement": {"prompts": len(prompts), "tokens": 64,
                             "definition": "equal prefix length / 64 against the fp32 torch model, averaged"},
        "rows": rows,
    }
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "onnx_cpu.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    (out / "onnx_cpu.md").write_text(_table(record), encoding="utf-8")
    print(_table(record))


def _table(r: dict[str, Any]) -> str:
    fp32 = next(x for x in r["rows"] if x["runtime"] == "onnxruntime fp32")
    lines = [f"Measured {r['date']} on {r['machine']}, {r['cpu_threads']} CPU threads (torch {r['torch']}, "
             f"onnxruntime {r['onnxruntime']}, transformers {r['transformers']}); model {r['model']['params']:,} "
             f"params ({r['model']['n_layers']} layers, d_model {r['model']['d_model']}, vocab "
             f"{r['model']['vocab_size']}), batch 1, {r['decode']['prompt_tokens']}-token prompt, "
             f"{r['decode']['new_tokens']} new tokens, median of {r['decode']['reps']}.", "",
             "| runtime | file bytes | tok/s | perplexity (held-out) | ppl delta vs fp32 | greedy agreement (64 tok) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        size = f"{x['file_bytes']:,}" if "file_bytes" in x else ""
        ppl = f"{x['perplexity']:.3f}" if "perplexity" in x else ""
        delta = f"{x['perplexity'] - fp32['perplexity']:+.3f}" if "perplexity" in x else ""
        agree = (f"{x['greedy_agreement']:.3f} ({x['greedy_equal']}/{r['greedy_agreement']['prompts']} equal)"
                 if "greedy_agreement" in x else "")
        lines.append(f"| {x['runtime']} | {size} | {x['tok_s']:.1f} | {ppl} | {delta} | {agree} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
