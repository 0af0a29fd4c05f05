"""``plyx model inspect PATH``: the card, parameter count, dtype and layout of a checkpoint."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from plyx.specs import CliCommand

__all__ = ["command"]


def _configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="print a checkpoint's card, parameter count, dtype and layout")
    p.add_argument("path", help="a plyx checkpoint or Hugging Face model directory")
    p.add_argument("--json", action="store_true", help="print the card as JSON")
    p.add_argument("--verify", action="store_true", help="also check every shard's size and sha256")


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{int(n)}"
        n /= 1000
    return f"{n:.1f}P"


def _run(args: argparse.Namespace) -> int:
    from plyx.model._checkpoint import open_checkpoint
    from plyx.model._errors import CheckpointError

    try:
        ckpt = open_checkpoint(args.path)
        if args.verify:
            ckpt.verify()
    except CheckpointError as exc:
        print(f"error: {exc}")
        return 1
    card = ckpt.card
    if args.json:
        print(json.dumps(card.to_dict(), indent=2))
        return 0
    c = card.model
    dtypes = Counter(e.dtype for e in card.tensors.values())
    sizes = {s: (ckpt.path / s).stat().st_size for s in ckpt.shards()}
    print(f"checkpoint   {ckpt.path}")
    print(f"name         {card.name}")
    print(f"card         version {card.version}, layout {card.layout}" + (f", created {card.created}" if card.created else ""))
    print(f"arch         {c.arch}: {c.n_layers} layers, d_model {c.d_model}, heads {c.n_heads}/{c.kv_heads} "
          f"(head_dim {c.dim_per_head}), d_ff {c.d_ff}, vocab {c.vocab_size}")
    print(f"features     tie_embeddings={c.tie_embeddings} qkv_bias={c.qkv_bias} qk_norm={c.qk_norm} "
          f"sliding_window={c.sliding_window} rope_theta={c.rope_theta:g} rope_scaling={c.rope_scaling}")
    if c.moe is not None:
        m = c.moe
        print(f"experts      {m.num_experts} of width {c.d_expert}, top-{m.top_k} "
              f"({'renormalised' if m.norm_topk_prob else 'raw softmax'} weights)"
              + (f", shared expert of width {m.shared_expert_d_ff}" if m.shared_expert_d_ff else "")
              + (", QK-norm over whole projections" if c.qk_norm_scope == "projection" else ""))
    print(f"parameters   {card.num_params:,} ({_human(card.num_params)})")
    print(f"dtype        {card.dtype} (" + ", ".join(f"{d}: {n} tensors" for d, n in dtypes.most_common()) + ")")
    print(f"tensors      {len(card.tensors)} in {len(sizes)} shard(s), {_human(sum(sizes.values()))}B")
    for shard, size in sizes.items():
        digest = card.shards.get(shard)
        print(f"  {shard}  {size:,} bytes" + (f"  sha256 {digest[:16]}..." if digest else ""))
    if args.verify:
        print("verified     sizes and digests match" if card.shards else "verified     sizes match the headers")
    for key in ("license", "tokenizer", "description"):
        if getattr(card, key):
            print(f"{key:<12} {getattr(card, key)}")
    if card.training:
        print(f"training     {json.dumps(card.training)}")
    return 0


def command() -> CliCommand:
    return CliCommand("model", "inspect model checkpoints (plyx or Hugging Face layout)", _configure, _run)
