"""Draft heads (Medusa, EAGLE): the papers' initialisation, the EAGLE layer's cache path, safetensors round
trip, and heads that do not fit their base or a path that is not heads, each named."""

from __future__ import annotations

import json

import pytest
import torch
from plyx.model import (
    DraftHeadsError,
    EagleDraft,
    MedusaHeads,
    TransformerLM,
    build_draft_heads,
    load_draft_heads,
    save_draft_heads,
)


@pytest.fixture
def base(tiny, random_model):
    return random_model(tiny())


def test_medusa_heads_start_as_the_base_lm_head(base):
    """Zero residual blocks and copied LM heads: every head's logits are the base's next-token logits."""
    heads = build_draft_heads("medusa", base.config, num_heads=3, num_layers=2).init_from_base(base)
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        out = heads(base(ids, return_hidden=True))  # (K, B, T, V)
        ref = base(ids)
    assert isinstance(heads, MedusaHeads) and out.shape == (3, 2, 9, base.config.vocab_size)
    for k in range(3):
        torch.testing.assert_close(out[k], ref, rtol=1e-5, atol=1e-5)


def test_medusa_resblock_is_x_plus_silu(base):
    heads = build_draft_heads("medusa", base.config, num_heads=1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    block, head = heads.heads[0][0], heads.heads[0][1]
    x = torch.randn(3, base.config.d_model)
    want = (x + torch.nn.functional.silu(x @ block.linear.weight.t() + block.linear.bias)) @ head.weight.t()
    torch.testing.assert_close(heads(x)[0], want)


def test_eagle_cached_steps_equal_the_full_pass(base):
    """Entries fed in two chunks through the draft layer's KV cache give the one-pass outputs (positions continue)."""
    from plyx.attn import make_cache

    draft = build_draft_heads("eagle", base.config).init_from_base(base)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert isinstance(draft, EagleDraft) and draft.config.n_layers == 1
    ids = torch.randint(0, base.config.vocab_size, (2, 10))
    w = base.embed_tokens.weight
    with torch.no_grad():
        feats = base(ids, return_hidden=True)
        full = draft(ids[:, 1:], feats[:, :-1], w)  # (B, 9, D)
        cache = make_cache("paged", draft.config, batch_size=2, max_seq_len=16)
        first = draft(ids[:, 1:6], feats[:, :5], w, cache=cache, seq_ids=[0, 1])
        second = draft(ids[:, 6:], feats[:, 5:-1], w, cache=cache, seq_ids=[0, 1])
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_save_load_round_trip(base, kind, tmp_path):
    heads = build_draft_heads(kind, base.config, num_heads=2)
    path = save_draft_heads(heads, tmp_path / "heads", base="runs/x/checkpoints/latest", extra={"step": 7})
    doc = json.loads((path / "draft_heads.json").read_text())
    assert doc["kind"] == kind and doc["step"] == 7 and doc["base"]["vocab_size"] == base.config.vocab_size
    loaded = load_draft_heads(path, base)
    assert type(loaded) is type(heads) and not loaded.training
    for (n1, a), (n2, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    assert not list(tmp_path.glob(".heads.tmp-*"))  # atomic: no temporary left


def test_heads_for_another_base_are_named(base, tiny, tmp_path):
    heads = build_draft_heads("medusa", base.config, num_heads=2)
    path = save_draft_heads(heads, tmp_path / "heads")
    other = TransformerLM(tiny(vocab_size=101, d_model=48))
    with pytest.raises(DraftHeadsError, match=r"vocab_size: 97 for the heads vs 101 for the base; d_model: 32 for the "
                                              r"heads vs 48 for the base.*train heads for this base"):
        load_draft_heads(path, other)


def test_a_path_that_is_not_heads_is_named(tmp_path, base):
    with pytest.raises(DraftHeadsError, match="does not exist"):
        load_draft_heads(tmp_path / "nope")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(DraftHeadsError, match="is not a draft-heads checkpoint: it has no draft_heads.json"):
        load_draft_heads(tmp_path / "ckpt")
    path = save_draft_heads(build_draft_heads("eagle", base.config), tmp_path / "heads")
    (path / "draft_heads.json").write_text('{"format": "something-else"}')
    with pytest.raises(DraftHeadsError, match="is not a draft-heads config"):
        load_draft_heads(path)
    path = save_draft_heads(build_draft_heads("eagle", base.config), tmp_path / "heads2")
    data = (path / "draft_heads.safetensors").read_bytes()
    (path / "draft_heads.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftHeadsError, match="cannot be read as safetensors"):
        load_draft_heads(path)
    with pytest.raises(DraftHeadsError, match="kind 'hydra' not found"):
        build_draft_heads("hydra", base.config)
