"""DPO step time and peak memory: LoRA vs full fine-tune, bf16 autocast, on a ~1B Llama-style plyx model.

    python packages/rl/bench/dpo_step.py                  # CUDA: the 1.1B model (TinyLlama's shape)
    python packages/rl/bench/dpo_step.py --size tiny      # anywhere: a 2-layer model (the CPU proof)

One step = the policy forward of ``batch`` chosen + ``batch`` rejected rows (prompt + completion),
log-probs through ``linear_cross_entropy``, the DPO sigmoid loss against cached reference log-probs,
backward, gradient clipping and an AdamW step (only the adapter's parameters with LoRA). The
reference log-probs are computed once before timing (with LoRA: the base, adapters disabled), as
``plyx rl dpo`` does; that pass is timed separately. Prints the device and the date and appends one
JSON line per mode to ``packages/rl/bench/results/dpo_step.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from plyx.model import TransformerLM
from plyx.rl import completion_rows, dpo_loss, token_logps
from plyx.specs import ModelConfig, OptimizerConfig, components

RESULTS = Path(__file__).resolve().parent / "results" / "dpo_step.jsonl"

SIZES = {
    # TinyLlama-1.1B's shape: 22 layers, 2048 wide, 32 heads (4 KV heads), SwiGLU 5632, vocab 32000
    "1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, max_seq_len=2048),
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256),
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, args: argparse.Namespace, device: torch.device) -> dict:
    from plyx.model.adapters import LoraConfig, add_adapter, disable_adapters, mark_only_adapters_trainable
    from plyx.train import param_groups

    torch.manual_seed(0)
    config = ModelConfig(arch="llama", **SIZES[args.size])
    model = TransformerLM(config, device=device)
    trainable = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        add_adapter(model, LoraConfig(r=args.rank, alpha=2 * args.rank, target_modules=LORA_TARGETS))
        trainable = mark_only_adapters_trainable(model)
    model.train()
    g = torch.Generator().manual_seed(1)
    V = config.vocab_size
    prompts = torch.randint(1, V, (args.batch, args.prompt_len), generator=g).tolist()
    chosen = torch.randint(1, V, (args.batch, args.completion_len), generator=g).tolist()
    rejected = torch.randint(1, V, (args.batch, args.completion_len), generator=g).tolist()
    batch = completion_rows(prompts * 2, chosen + rejected, pad_id=0).to(device)  # (2B, P + C)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()

    # the reference: once, cached (LoRA: the base with adapters disabled, no second model)
    _sync(device)
    t = time.perf_counter()
    with torch.no_grad(), autocast, (disable_adapters(model) if mode == "lora" else contextlib.nullcontext()):
        ref = token_logps(model, batch)[0].sum(-1)
    _sync(device)
    ref_s = time.perf_counter() - t
    ref_c, ref_r = ref[: args.batch], ref[args.batch:]

    optim_cfg = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    optimizer = components("plyx_optimizers")["adamw"].factory(param_groups(model, 0.0), optim_cfg)
    params = [p for grp in optimizer.param_groups for p in grp["params"]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(args.warmup + args.steps):
        _sync(device)
        t = time.perf_counter()
        with autocast:
            logps, mask = token_logps(model, batch)
            sums = logps.sum(-1)
            out = dpo_loss(sums[: args.batch], sums[args.batch:], ref_c, ref_r, beta=0.1)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    tokens = 2 * args.batch * (args.prompt_len + args.completion_len)
    ms = statistics.median(times) * 1e3
    return {"mode": mode, "params": sum(p.numel() for p in model.parameters()), "trainable": int(trainable),
            "ms_per_step": round(ms, 2), "ms_min": round(min(times) * 1e3, 2), "tokens_per_step": tokens,
            "tokens_per_s": round(tokens / (ms / 1e3), 1), "peak_mem_mib": None if peak is None else round(peak, 1),
            "reference_pass_s": round(ref_s, 4), "final_loss": float(out.loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), help="model size (default: 1b on CUDA, tiny on CPU)")
    parser.add_argument("--modes", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--batch", type=int, default=4, help="preference pairs per step")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="float32 instead of bf16 autocast")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.size = args.size or ("1b" if device.type == "cuda" else "tiny")
    if device.type == "cpu" and args.size == "tiny":
        args.prompt_len, args.completion_len = min(args.prompt_len, 32), min(args.completion_len, 32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"device: {device.type} ({name}); date: {date}; torch {torch.__version__}; size {args.size}; "
          f"{args.batch} pairs x ({args.prompt_len} + {args.completion_len}) tokens; bf16 autocast {args.bf16}")
    for mode in args.modes.split(","):
        row = run_mode(mode.strip(), args, device)
        record = {"bench": "dpo_step", "date": date, "device": f"{device.type} ({name})", "torch": torch.__version__,
                  "size": args.size, "bf16_autocast": args.bf16, "batch_pairs": args.batch,
                  "prompt_len": args.prompt_len, "completion_len": args.completion_len, "lora_rank": args.rank,
                  **row}
        print(json.dumps(record))
        if not args.no_record:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            with RESULTS.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
