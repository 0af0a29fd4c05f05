"""Multi-LoRA serving throughput: a batch of requests spread over 1, 4 or 16 resident adapters, against the base
model alone, in one run on the same weights.

Every configuration runs the same requests (``--requests`` prompts of ``--prompt`` random tokens, greedy,
``--new-tokens`` tokens each, EOS ignored) through the continuous-batching engine; request i uses adapter
``i mod N`` (N = 0: the base only). Adapters are random rank-``--rank`` LoRAs on every projection (q, k, v, o,
gate, up, down), saved as PEFT directories and loaded the way ``plyx serve --lora`` loads them.

    python packages/serve/bench/bench_multi_lora.py --config 100m --adapters 0,1,4,16 --requests 32

Results: printed, and appended as JSON lines to ``bench/results/multi-lora-<device>.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=704),
    "100m": dict(vocab_size=32000, d_model=768, n_layers=10, n_heads=12, n_kv_heads=4, d_ff=2048),
    "1.1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(name: str):
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**CONFIGS[name], max_seq_len=2048, init_std=0.02)).eval()


def save_adapters(base, n: int, rank: int, out: Path) -> dict[str, str]:
    from plyx.model.adapters import LoraConfig, add_adapter, delete_adapter, save_peft

    model = copy.deepcopy(base)
    paths = {}
    for i in range(n):
        torch.manual_seed(100 + i)
        add_adapter(model, LoraConfig(r=rank, alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False),
                    f"a{i}")
        save_peft(model, out / f"a{i}", name=f"a{i}")
        delete_adapter(model, f"a{i}")
        paths[f"a{i}"] = str(out / f"a{i}")
    return paths


def run(model, lora, prompts, new_tokens: int, n_adapters: int, device: str, max_batch: int) -> float:
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    engine = Engine(model, lora=lora, config=EngineConfig(max_batch_size=max_batch, max_batch_tokens=2048,
                                                          block_size=16, prefix_caching=False, cuda_graphs=False))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    names = lora.names if lora is not None else []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, adapter=names[i % n_adapters] if n_adapters else None)
    while engine.has_unfinished():
        engine.step()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--adapters", default="0,1,4,16", help="adapter counts to compare (0: the base alone)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="best of N, the configurations alternating")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from plyx.serve._lora import MultiLora

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    base = build(args.config)
    counts = [int(c) for c in args.adapters.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, CONFIGS[args.config]["vocab_size"], (args.prompt,), generator=g).tolist()
               for _ in range(args.requests)]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# multi-LoRA throughput: {args.config}, {args.device} ({device_name}), {dtype}, {date}; rank {args.rank} "
          f"on {', '.join(TARGETS)}; {args.requests} requests x {args.new_tokens} tokens, prompt {args.prompt}")
    print("| adapters | output tok/s | vs base |")
    print("|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_adapters(base, max(counts), args.rank, Path(tmp)) if max(counts) else {}
        served = []
        for n in counts:
            model = copy.deepcopy(base)
            lora = MultiLora.load(model, {k: paths[k] for k in list(paths)[:n]}) if n else None
            served.append((n, model.to(device=args.device, dtype=dtype), lora))  # buffers move with the model
            run(served[-1][1], lora, prompts[:2], 4, n, args.device, args.requests)  # warm-up
        best = [float("inf")] * len(served)
        for _ in range(args.repeats):  # alternate the configurations, so load drifts on a shared machine hit all
            for i, (n, model, lora) in enumerate(served):
                best[i] = min(best[i], run(model, lora, prompts, args.new_tokens, n, args.device, args.requests))
        for (n, _, _), seconds in zip(served, best):
            tok_s = args.requests * args.new_tokens / seconds
            rows.append({"adapters": n, "tok_s": tok_s})
            print(f"| {n or 'base only'} | {tok_s:.1f} | {tok_s / rows[0]['tok_s']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    with open(out / f"multi-lora-{tag}.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps({"date": date, "device": device_name, "config": args.config, "dtype": str(dtype),
                                "rank": args.rank, "requests": args.requests, "new_tokens": args.new_tokens,
                                "prompt": args.prompt, **row, "vs_base": row["tok_s"] / rows[0]["tok_s"]}) + "\n")


if __name__ == "__main__":
    main()
