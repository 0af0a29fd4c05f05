"""Forward tokens/s on CPU of a ~100M-parameter Llama-shaped model: plyx vs transformers, same weights, one run.

The transformers model is built first with random weights and saved; plyx
loads that directory, so both run identical weights (the logits are checked
equal before timing). Each configuration (batch x sequence) is timed for both
side by side, interleaved, best of ``--reps``; the ratio plyx / transformers is printed.

Usage::

    python packages/model/bench/forward_cpu.py [--threads N] [--reps 5] [--dtype float32|bfloat16]

Results are appended to ``packages/model/bench/results/forward_cpu.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "forward_cpu.jsonl"
#: ~100M parameters: 12 layers of d_model 640 (GQA 10/5 heads, d_ff 1728) and a 32k vocabulary, untied
CONFIG = dict(hidden_size=640, num_hidden_layers=12, num_attention_heads=10, num_key_value_heads=5,
              intermediate_size=1728, vocab_size=32000, max_position_embeddings=2048)
SHAPES = [(1, 128), (1, 512), (4, 256)]


def best_time(fn, reps: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from plyx.model import load_checkpoint

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        plyx = load_checkpoint(tmp, dtype=args.dtype).eval()
    params = plyx.num_params()
    print(f"model: {params / 1e6:.1f}M parameters, {args.dtype}, {args.threads} threads, "
          f"transformers {transformers.__version__} (attn {hf.config._attn_implementation}), torch {torch.__version__}")
    rows = []
    with torch.inference_mode():
        ids = torch.randint(0, CONFIG["vocab_size"], (1, 64))
        diff = (plyx(ids) - hf(ids).logits.float()).abs().max().item()
        print(f"max |logits difference| on a check batch: {diff:.2e}")
        print(f"{'batch x seq':>12} {'plyx tok/s':>12} {'transformers tok/s':>19} {'ratio':>7}")
        for batch, seq in SHAPES:
            ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq))
            t_plyx = best_time(lambda ids=ids: plyx(ids), args.reps)
            t_hf = best_time(lambda ids=ids: hf(ids, use_cache=False).logits.float(), args.reps)
            tok = batch * seq
            row = {"batch": batch, "seq": seq, "plyx_tok_s": tok / t_plyx, "hf_tok_s": tok / t_hf,
                   "ratio": t_hf / t_plyx}
            rows.append(row)
            print(f"{batch:>5} x {seq:<5} {row['plyx_tok_s']:>12.0f} {row['hf_tok_s']:>19.0f} {row['ratio']:>7.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpu": platform.processor() or platform.machine(), "threads": args.threads, "dtype": args.dtype,
            "params": params, "torch": torch.__version__, "transformers": transformers.__version__,
            "max_abs_logit_diff": diff}
    with RESULTS.open("a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
