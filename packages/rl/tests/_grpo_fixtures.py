"""Shared pieces of the GRPO tests: a tiny model, the byte tokenizer with ChatML, a prompts file."""

from __future__ import annotations

import json
from pathlib import Path

from plyx.rl._chat import ChatTemplate
from plyx.rl._demo import CHATML, build_tokenizer

VOCAB = 320


def tiny_model(seed: int = 0, *, d_model: int = 32, n_layers: int = 1):
    import torch
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(arch="llama", vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=2,
                                     d_ff=64, max_seq_len=128, tie_embeddings=True))


def setup_run(root: Path, n_prompts: int = 12) -> tuple[object, ChatTemplate, Path]:
    """The tokenizer (written to root/tok), the template and a prompts file of sort tasks."""
    from plyx.rl import make_tasks

    tok = build_tokenizer(root / "tok")
    template = ChatTemplate(CHATML, eos_token=tok.eos_token, name="chatml")
    tasks = make_tasks(n_prompts, split="train", kinds=("sort", "add"))
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t.prompt}], "answer": t.answer}) + "\n"
                            for t in tasks), encoding="utf-8")
    return tok, template, path
