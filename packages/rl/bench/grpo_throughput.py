"""GRPO throughput: samples/s and tokens/s of ``plyx rl grpo``'s loop on a ~0.5B random-weight model.

    python packages/rl/bench/grpo_throughput.py                 # CUDA: Qwen2.5-0.5B's shape, bf16 engine
    python packages/rl/bench/grpo_throughput.py --size tiny     # any machine: proves the script

Each step is the real loop (``plyx.rl.grpo``): ``--prompts`` random prompts of ``--prompt-len`` tokens, G
completions each of up to ``--max-new-tokens`` sampled by plyx-serve's engine in-process (bf16 weights, CUDA
graphs for decode), a reward that varies within groups (a hash of the completion's ids: the benchmark
measures the machinery, not learning), clipped policy-gradient updates of the float32 policy under bf16
autocast with the prompt shared across each group, and the in-place weight sync into the engine. The first
``--warmup`` steps (graph capture, allocator) are left out of the figures.

Reports per step: generation / training / sync seconds, samples/s (completions per second of step wall
time), generated tokens/s (of generation time) and trained tokens/s (prompt + completion tokens of the
log-prob pass per second of training time). Appends one JSON line to
``packages/rl/bench/results/grpo_throughput.jsonl`` (device, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import platform
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from plyx.specs import Component, hookimpl

RESULTS = Path(__file__).resolve().parent / "results" / "grpo_throughput.jsonl"

SIZES = {
    "tiny": dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192),
    "0.5b": dict(vocab_size=151_936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864),
    "1b": dict(vocab_size=32_000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),
}


class _HashReward:
    """Reward plugin of the benchmark: 1 for about half the completions (a hash of their ids), 0 otherwise."""

    @staticmethod
    def _factory(**_):
        def reward(prompts, completions, completion_ids, **columns):
            return [float(hashlib.sha256(str(ids).encode()).digest()[0] % 2) for ids in completion_ids]
        return reward

    @hookimpl
    def plyx_reward_functions(self):
        return [Component("bench_hash", self._factory, "throughput benchmark: a hash of the completion ids")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 0.5b on CUDA, tiny on CPU")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--loss-type", default="grpo")
    parser.add_argument("--beta", type=float, default=0.0, help="> 0 keeps a reference model (one more forward)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-groups", type=int, default=4)
    parser.add_argument("--share-prompt", choices=("auto", "on", "off"), default="auto",
                        help="the log-prob pass's prompt sharing (auto: the config default, shared on CPU only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from plyx.model import TransformerLM
    from plyx.rl import GRPOConfig, RewardSpec, grpo
    from plyx.rl._demo import build_tokenizer
    from plyx.specs import ModelConfig, OptimizerConfig, plugins

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    size = args.size or ("0.5b" if cuda else "tiny")
    shape = SIZES[size]
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    where = (f"cuda ({torch.cuda.get_device_name(device)})" if cuda
             else f"cpu ({platform.processor() or platform.machine()}, {args.threads} thread(s))")
    work = Path(tempfile.mkdtemp(prefix="plyx-grpo-throughput-"))
    tok = build_tokenizer(work / "tok")  # byte-level: prompts are random text, one token per character
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(args.prompt_len))})
                            + "\n" for _ in range(args.prompts * (args.steps + args.warmup))), encoding="utf-8")
    torch.manual_seed(0)
    max_length = args.prompt_len + args.max_new_tokens + 16
    model = TransformerLM(ModelConfig(arch="llama", max_seq_len=max_length, tie_embeddings=True, **shape)).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"device: {where}; date: {started}; torch {torch.__version__}; model {size} ({params / 1e6:.0f}M params)")
    print(f"{args.prompts} prompts x G={args.group}, prompt {args.prompt_len} tokens, up to {args.max_new_tokens} "
          f"new tokens, loss {args.loss_type}, beta {args.beta}")
    plugins.register_plugin(_HashReward(), "bench-hash-reward")
    config = GRPOConfig(
        data=str(data), out_dir=str(work / "run"), steps=args.steps + args.warmup, batch_size=args.prompts,
        num_generations=args.group, max_new_tokens=args.max_new_tokens, max_length=max_length,
        loss_type=args.loss_type, beta=args.beta, optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
        rewards=(RewardSpec(name="bench_hash"),), accuracy_reward="", device=str(device),
        precision="bf16-autocast" if cuda else "float32", micro_batch_groups=args.micro_batch_groups,
        share_prompt={"auto": None, "on": True, "off": False}[args.share_prompt], engine_max_batch_size=min(256, args.prompts * args.group),
        log_every=1, temperature=1.0)
    try:
        result = grpo(config, model=model, tokenizer=tok, print_fn=print)
    finally:
        plugins.unregister_plugin("bench-hash-reward")
        shutil.rmtree(work, ignore_errors=True)  # the run's checkpoint and state: not part of the result
    rows = result.history[args.warmup:]
    if not rows:
        raise SystemExit("no measured step: raise --steps")
    completions = args.prompts * args.group

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    gen, train, sync = med("gen_s"), med("train_s"), med("sync_s")
    length = med("completion_length")
    step_s = gen + train + sync
    record = {
        "bench": "grpo_throughput", "date": started, "device": where, "torch": torch.__version__, "model": size,
        "params": params, "prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens, "loss_type": args.loss_type, "beta": args.beta,
        "share_prompt": args.share_prompt, "measured_steps": len(rows),
        "step_s": step_s, "gen_s": gen, "train_s": train, "sync_ms": sync * 1e3, "gen_share": gen / step_s,
        "completion_length": length,
        "samples_per_s": completions / step_s,
        "generated_tokens_per_s": completions * length / gen,
        "trained_tokens_per_s": completions * (args.prompt_len + length) / train,
        "end_to_end_tokens_per_s": completions * length / step_s,
    }
    if cuda:
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"step {step_s:.2f} s (generation {gen:.2f} s = {gen / step_s:.0%}, training {train:.2f} s, sync "
          f"{sync * 1e3:.1f} ms); {record['samples_per_s']:.1f} samples/s, {record['generated_tokens_per_s']:.0f} "
          f"generated tokens/s, {record['trained_tokens_per_s']:.0f} trained tokens/s")
    if not args.no_record:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
