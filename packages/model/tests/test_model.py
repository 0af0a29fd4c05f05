"""TransformerLM forward for training: shapes, dtypes, packed documents, padding, gradients, accounting."""

from __future__ import annotations

import pytest
import torch
from plyx.model import TransformerLM
from plyx.specs import ModelConfig


def test_logits_shape_dtype_and_hidden(tiny, random_model) -> None:
    model = random_model(tiny())
    ids = torch.randint(0, 97, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 97) and logits.dtype == torch.float32
    hidden = model(ids, return_hidden=True)
    assert hidden.shape == (3, 10, 32)
    torch.testing.assert_close(hidden @ model.lm_head_weight.T, logits)


def test_causal_prefix_does_not_see_the_future(tiny, random_model) -> None:
    model = random_model(tiny())
    ids = torch.randint(0, 97, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 97
    torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8])
    assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])


def test_packed_documents_equal_separate_sequences(tiny, random_model) -> None:
    model = random_model(tiny(arch="qwen3", qk_norm=True, head_dim=16))
    a, b, c = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 3)), torch.randint(0, 97, (1, 4))
    packed = torch.cat([a, b, c], dim=1)
    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4])
    out = model(packed, document_ids=docs)  # positions restart per document by default
    want = torch.cat([model(a), model(b), model(c)], dim=1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_left_padding_equals_unpadded(tiny, random_model) -> None:
    model = random_model(tiny(sliding_window=4, arch="mistral"))
    short, long = torch.randint(0, 97, (1, 4)), torch.randint(0, 97, (1, 9))
    ids = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0] * 5 + [1] * 4, [1] * 9])
    out = model(ids, attention_mask=mask)
    torch.testing.assert_close(out[0, 5:], model(short)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], model(long)[0], rtol=1e-5, atol=1e-5)


def test_training_backward_reaches_every_parameter(tiny, random_model) -> None:
    model = random_model(tiny(arch="qwen2", qkv_bias=True)).train()
    ids = torch.randint(0, 97, (2, 8))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no finite gradient for {missing}"


def test_gradient_matches_finite_differences(tiny, random_model) -> None:
    """float64 gradcheck of the whole model w.r.t. one weight (kernels' backward wired correctly)."""
    config = tiny(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=11)
    model = random_model(config).double()
    ids = torch.randint(0, 11, (1, 5))
    weight = model.layers[0].self_attn.k_proj.weight

    def f(w: torch.Tensor) -> torch.Tensor:
        # the hidden states stay float64 (logits are always returned in float32)
        state = {"layers.0.self_attn.k_proj.weight": w}
        return torch.func.functional_call(model, state, (ids,), {"return_hidden": True}).sum()

    assert torch.autograd.gradcheck(f, (weight.detach().clone().requires_grad_(),), eps=1e-6, atol=1e-5)


def test_tied_embeddings_and_param_count(tiny) -> None:
    tied = TransformerLM(tiny(tie_embeddings=True))
    untied = TransformerLM(tiny())
    assert tied.lm_head_weight is tied.embed_tokens.weight
    assert untied.num_params() - tied.num_params() == 97 * 32
    c = tiny()
    per_layer = 2 * 32 + 32 * 32 + 2 * (2 * 8 * 32) + 32 * 32 + 3 * 32 * 48
    assert untied.num_params() == 97 * 32 * 2 + 32 + 2 * per_layer
    assert untied.flops_per_token(100) == 6 * (untied.num_params() - 97 * 32) + 12 * 2 * 4 * 8 * 100
    assert c.dim_per_head == 8


def test_bfloat16_model(tiny) -> None:
    model = TransformerLM(tiny(dtype="bfloat16"))
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    logits = model(torch.randint(0, 97, (1, 6)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_partial_rotary_and_llama3_scaling_run(tiny, random_model) -> None:
    from plyx.specs import RopeScaling

    model = random_model(tiny(partial_rotary=0.5, rope_scaling=RopeScaling(kind="llama3", original_max_seq_len=16)))
    assert model.rotary_dim == 4
    assert torch.isfinite(model(torch.randint(0, 97, (1, 20)))).all()


def test_bad_inputs_are_named(tiny) -> None:
    model = TransformerLM(tiny())
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="plyx.specs.ModelConfig"):
        TransformerLM({"d_model": 32})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be combined"):
        from plyx.attn import make_cache

        model(torch.zeros(1, 3, dtype=torch.long), document_ids=torch.zeros(1, 3), cache=make_cache("paged", model.config))


def test_meta_device_builds_no_storage() -> None:
    model = TransformerLM(ModelConfig(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, vocab_size=128256), device="meta")
    assert model.num_params() > 7e9
    assert all(p.is_meta for p in model.parameters())


def test_default_position_tables_are_computed_once_and_equal_explicit_positions(tiny, random_model) -> None:
    """Training batches without positions reuse one (cos, sin) pair per length: the same logits and gradients,
    bit for bit, as passing ``position_ids=arange(T)``, which computes the tables each call."""
    config = tiny()
    model = random_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 7))
    cached = model(ids)
    tables = model._arange_tables(7, ids.device, torch.float32)
    assert model._arange_tables(7, ids.device, torch.float32) is tables  # the same tensors every step
    explicit = model(ids, position_ids=torch.arange(7))
    assert torch.equal(cached, explicit)
    g1 = torch.autograd.grad(model(ids).square().mean(), list(model.parameters()))
    g2 = torch.autograd.grad(model(ids, position_ids=torch.arange(7)).square().mean(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    with torch.inference_mode():  # tables made here could not serve a training step: not kept
        model(torch.randint(0, config.vocab_size, (1, 5)))
    assert (ids.device, torch.float32, 5) not in model._arange_rope
