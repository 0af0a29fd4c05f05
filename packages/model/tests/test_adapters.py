"""Adapters (LoRA, rsLoRA, DoRA) on plyx models: each variant against a float64 formula, merge/unmerge,
several named adapters, the base output when disabled, LoRA+ groups, the cached and static decode paths,
variants from plugins, and bad input.
"""

from __future__ import annotations

import math

import pytest
import torch
from plyx.model.adapters import (
    AdapterError,
    AdapterVariant,
    LoraConfig,
    LoraLinear,
    active_adapter,
    adapter_state_dict,
    add_adapter,
    delete_adapter,
    disable_adapters,
    list_adapters,
    lora_plus_param_groups,
    mark_only_adapters_trainable,
    merge_adapter,
    merge_and_unload,
    set_adapter,
    unmerge_adapter,
)
from torch import nn

VARIANTS = ["lora", "rslora", "dora"]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _scaling(variant: str, r: int, alpha: float) -> float:
    return alpha / math.sqrt(r) if variant == "rslora" else alpha / r


def _reference(x, W, b, A, B, m, s, variant):
    """The published formulas in float64: LoRA ``W x + b + s B A x``; DoRA ``m / n * (W + s B A) x + b``
    with ``n = ||W + s B A||_row`` detached (DoRA section 4.3, as PEFT)."""
    delta = s * B @ A  # (out, in)
    if variant != "dora":
        return x @ (W + delta).T + b
    n = torch.linalg.vector_norm(W + delta, dim=1).detach()  # (out,)
    return x @ ((m / n)[:, None] * (W + delta)).T + b


def _layer(dtype, *, bias=True):
    torch.manual_seed(3)
    holder = nn.ModuleDict({"proj": nn.Linear(20, 12, bias=bias, dtype=dtype)})
    with torch.no_grad():
        holder["proj"].weight.normal_(0, 0.5)
    return holder


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_variant_forward_and_gradients_match_the_float64_formula(variant, dtype):
    holder = _layer(dtype)
    r, alpha = 4, 6.0
    add_adapter(holder, LoraConfig(r=r, alpha=alpha, target_modules=("proj",), variant=variant, init_lora_weights=False))
    layer = holder["proj"]
    assert isinstance(layer, LoraLinear)
    x = torch.randn(3, 5, 20, dtype=dtype, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    params = {"W": layer.weight, "b": layer.bias, "A": layer.lora_A["default"].weight, "B": layer.lora_B["default"].weight}
    if variant == "dora":
        params["m"] = layer.lora_magnitude_vector["default"]
    ref = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    xr = x.detach().double().requires_grad_()
    yr = _reference(xr, ref["W"], ref["b"], ref["A"], ref["B"], ref.get("m"), _scaling(variant, r, alpha), variant)
    yr.backward(g.double())
    # float64: rounding only; float32: ~1e-7 relative per op over sums of 20-term products; bfloat16: 2^-8
    # relative per rounding, a few roundings deep, on outputs and gradients of size ~1-5
    tol = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5),
           torch.bfloat16: dict(rtol=3e-2, atol=6e-2)}[dtype]
    torch.testing.assert_close(y.double(), yr, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    for k, p in params.items():
        torch.testing.assert_close(p.grad.double(), ref[k].grad, **tol, msg=lambda m, k=k: f"grad of {k}: {m}")
    if variant == "dora":  # m starts at the row norms of W + s B A
        n = torch.linalg.vector_norm(ref["W"] + _scaling(variant, r, alpha) * ref["B"] @ ref["A"], dim=1)
        torch.testing.assert_close(params["m"].detach().double(), n.detach(), **tol)


def test_default_init_starts_at_the_base_output(tiny, random_model):
    model = random_model(tiny())
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        base = model(ids)
        for variant in VARIANTS:
            add_adapter(model, LoraConfig(r=4, target_modules=ALL, variant=variant), variant)
            set_adapter(model, variant)
            torch.testing.assert_close(model(ids), base, rtol=1e-6, atol=1e-6)


def test_dropout_only_in_train_mode():
    holder = _layer(torch.float64)
    add_adapter(holder, LoraConfig(r=4, dropout=0.5, target_modules=("proj",), init_lora_weights=False))
    layer = holder["proj"]
    x = torch.randn(64, 20, dtype=torch.float64)
    layer.eval()
    full = layer(x)
    s = layer.scaling["default"]
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(full, x @ (layer.weight + s * B @ A).T + layer.bias)
    layer.train()
    torch.manual_seed(5)
    dropped = layer(x)
    torch.manual_seed(5)
    kept = torch.nn.functional.dropout(x, 0.5, training=True)  # the same draw
    torch.testing.assert_close(dropped, x @ layer.weight.T + layer.bias + s * kept @ A.T @ B.T)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_equals_unmerged_and_unmerge_restores_the_base(tiny, random_model, variant):
    model = random_model(tiny(qkv_bias=True))
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    add_adapter(model, LoraConfig(r=4, alpha=8, target_modules=ALL, variant=variant, init_lora_weights=False))
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        adapted = model(ids)
        merge_adapter(model)
        torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)
        merge_adapter(model)  # merging twice is one merge
        torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)
        unmerge_adapter(model)
        torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)
    for k, v in base_state.items():  # float32 add then subtract in float32: within an ulp or two of |W| ~ 1
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_several_adapters_switch_and_disable(tiny, random_model):
    model = random_model(tiny())
    ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        base = model(ids)
        add_adapter(model, LoraConfig(r=2, target_modules=("q_proj", "v_proj"), init_lora_weights=False), "a")
        only_a = model(ids)
        add_adapter(model, LoraConfig(r=4, target_modules=("up_proj",), variant="dora", init_lora_weights=False), "b")
        assert list_adapters(model) == ["a", "b"] and active_adapter(model) == "a"  # the first added stays active
        torch.testing.assert_close(model(ids), only_a)
        set_adapter(model, "b")
        only_b = model(ids)
        assert (only_b - only_a).abs().max() > 1e-3 and (only_b - base).abs().max() > 1e-3
        with disable_adapters(model):
            torch.testing.assert_close(model(ids), base)
        torch.testing.assert_close(model(ids), only_b)
        merge_adapter(model)
        with disable_adapters(model):  # a merged adapter is taken out for the block, then merged again
            torch.testing.assert_close(model(ids), base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids), only_b, rtol=1e-5, atol=1e-5)
        with pytest.raises(AdapterError, match="unmerge_adapter"):
            set_adapter(model, "a")
        with pytest.raises(AdapterError, match="unmerge_adapter"):
            delete_adapter(model, "b")
        unmerge_adapter(model)
        delete_adapter(model, "b")
        assert active_adapter(model) == "a" and list_adapters(model) == ["a"]
        assert type(model.layers[0].mlp.up_proj) is nn.Linear  # no adapter left there: a plain linear again
        torch.testing.assert_close(model(ids), only_a)
        merged = merge_and_unload(model)
        assert merged is model and not any(isinstance(m, LoraLinear) for m in model.modules())
        assert list_adapters(model) == [] and set(model.state_dict()) == set(_fresh_names(model))
        torch.testing.assert_close(model(ids), only_a, rtol=1e-5, atol=1e-5)


def _fresh_names(model):
    from plyx.model import TransformerLM

    return TransformerLM(model.config, device="meta").state_dict()


def test_training_moves_only_the_adapter(tiny, random_model):
    """A few AdamW steps on the adapted model (the Trainer's forward: hidden states, then the LM head)."""
    model = random_model(tiny()).train()
    add_adapter(model, LoraConfig(r=4, alpha=8, target_modules=ALL, variant="dora"))
    n = mark_only_adapters_trainable(model)
    expected = sum(p.numel() for p in adapter_state_dict(model).values())
    assert n == expected == sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    opt = torch.optim.AdamW(lora_plus_param_groups(model, 1e-2, ratio=4.0))
    ids = torch.randint(0, 97, (4, 12))
    losses = []
    for _ in range(8):
        hidden = model(ids[:, :-1], return_hidden=True)
        logits = hidden @ model.lm_head_weight.T
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for k, v in frozen.items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_autocast_training_step(tiny, random_model, variant):
    """The Trainer's bf16-autocast precision: float32 adapter parameters, bf16 matmuls, float32 gradients."""
    model = random_model(tiny()).train()
    add_adapter(model, LoraConfig(r=4, target_modules=ALL, variant=variant, init_lora_weights=False))
    mark_only_adapters_trainable(model)
    ids = torch.randint(0, 97, (2, 8))
    want = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids)
    got.float().logsumexp(-1).mean().backward()
    # bf16 matmuls through 2 layers: ~1e-2 relative on logits of size ~5
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=1.5e-1)
    grads = [p.grad for p in model.parameters() if p.requires_grad]  # the adapters (base frozen)
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_lora_plus_groups():
    holder = _layer(torch.float32)
    holder["norm"] = nn.LayerNorm(12)
    add_adapter(holder, LoraConfig(r=2, target_modules=("proj",), variant="dora", lora_plus_ratio=16.0))
    groups = {g["name"]: g for g in lora_plus_param_groups(holder, 1e-4, weight_decay=0.1)}
    layer = holder["proj"]
    ids = {k: {id(p) for p in g["params"]} for k, g in groups.items()}
    assert ids["lora_A"] == {id(layer.lora_A["default"].weight)}
    assert ids["lora_B"] == {id(layer.lora_B["default"].weight), id(layer.lora_magnitude_vector["default"])}
    assert ids["base"] == {id(layer.weight)}
    assert ids["base_no_decay"] == {id(layer.bias), id(holder["norm"].weight), id(holder["norm"].bias)}
    assert groups["lora_A"]["lr"] == 1e-4 and groups["lora_B"]["lr"] == pytest.approx(16e-4)
    assert groups["lora_B"]["weight_decay"] == 0.1 and groups["base_no_decay"]["weight_decay"] == 0.0
    mark_only_adapters_trainable(holder)
    assert [g["name"] for g in lora_plus_param_groups(holder, 1e-4)] == ["lora_A", "lora_B"]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_cached_and_static_decode_honour_the_adapter(tiny, random_model, kind):
    """Prefill + decode with a cache, and the static step over packed q/k/v and gate/up weights with the fused
    norm/SwiGLU kernels: every path gives the adapted model's logits (packed weights are used only once merged)."""
    from plyx.attn import StaticDecode, make_cache, packed_linear

    model = random_model(tiny())
    add_adapter(model, LoraConfig(r=4, target_modules=ALL, variant="dora", init_lora_weights=False))
    ids = torch.randint(0, 97, (2, 10))
    with torch.inference_mode():
        want = model(ids)
        model.pack_projections_()
        attn = model.layers[0].self_attn
        assert packed_linear((attn.q_proj, attn.k_proj, attn.v_proj)) is None  # an unmerged adapter: not packed
        for merged in (False, True):
            if merged:
                merge_adapter(model)  # in place: the packed buffers now hold W' and are used again
                assert packed_linear((attn.q_proj, attn.k_proj, attn.v_proj)) is not None
            cache = make_cache(kind, model.config, batch_size=2, max_seq_len=32, dtype=torch.float32)
            got = [model(ids[:, :6], cache=cache, seq_ids=[0, 1])]
            decode = StaticDecode(cache, max_batch=2)
            for t in range(6, 10):  # static one-row-per-sequence steps (fused kernels at <= 2 rows)
                decode.prepare([0, 1], ids[:, t], 2)
                step_ids, positions, step = decode.inputs(2)
                got.append(model(step_ids, position_ids=positions, kv_step=step))
            torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-4, atol=1e-4)


class _Doubled(AdapterVariant):
    """A third-party variant: LoRA at twice the scale."""

    name = "doubled"

    def scaling(self, r: int, alpha: float) -> float:
        return 2 * alpha / r


def test_a_variant_from_a_plugin_is_used():
    from plyx.specs import Component, hookimpl
    from plyx.specs.plugins import register_plugin, unregister_plugin

    class Plugin:
        @hookimpl
        def plyx_adapter_variants(self):
            return [Component("doubled", _Doubled, "LoRA at twice the scale")]

    holder = _layer(torch.float64)
    with pytest.raises(AdapterError, match="'doubled' not found.*dora"):
        add_adapter(holder, LoraConfig(r=2, alpha=3, target_modules=("proj",), variant="doubled"))
    register_plugin(Plugin(), "test-doubled-variant")
    try:
        add_adapter(holder, LoraConfig(r=2, alpha=3, target_modules=("proj",), variant="doubled",
                                       init_lora_weights=False))
    finally:
        unregister_plugin("test-doubled-variant")
    layer = holder["proj"]
    assert isinstance(layer.variants["default"], _Doubled) and layer.scaling["default"] == 3.0

    class Broken:
        @hookimpl
        def plyx_adapter_variants(self):
            return [Component("broken", lambda: object(), "not an AdapterVariant")]

    register_plugin(Broken(), "test-broken-variant")
    try:
        with pytest.raises(AdapterError, match="'broken'.*built object, not a plyx.model.adapters.AdapterVariant"):
            add_adapter(holder, LoraConfig(target_modules=("proj",), variant="lora"), "other")
    finally:
        unregister_plugin("test-broken-variant")
    x = torch.randn(4, 20, dtype=torch.float64)
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(layer(x), x @ (layer.weight + 3.0 * B @ A).T + layer.bias)


def test_bad_input_is_named(tiny, random_model):
    model = random_model(tiny())
    with pytest.raises(AdapterError, match=r"\['qproj', 'vv'\] matched no module.*'q_proj'.*'up_proj'"):
        add_adapter(model, LoraConfig(target_modules=("qproj", "vv")))
    for bad in (0, -2, 1.5):
        with pytest.raises(AdapterError, match="r must be a positive int"):
            LoraConfig(r=bad)
    with pytest.raises(AdapterError, match="dropout"):
        LoraConfig(dropout=1.0)
    with pytest.raises(AdapterError, match="not a valid regex"):
        LoraConfig(target_modules=("re:layers.(",))
    with pytest.raises(AdapterError, match="lm_head_weight"):
        add_adapter(model, LoraConfig(target_modules=("lm_head",)))
    with pytest.raises(AdapterError, match="not nn.Linear.*self_attn"):
        add_adapter(model, LoraConfig(target_modules=("re:layers\\.0\\.self_attn.*",)))
    assert list_adapters(model) == [] and not any(isinstance(m, LoraLinear) for m in model.modules())
    add_adapter(model, LoraConfig(target_modules=("re:layers\\.1\\.self_attn\\.[qv]_proj",)), "one")
    assert sorted(p for p, m in model.named_modules() if isinstance(m, LoraLinear)) == [
        "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
    with pytest.raises(AdapterError, match="already"):
        add_adapter(model, LoraConfig(), "one")
    with pytest.raises(AdapterError, match="'two' is not on this model.*one"):
        set_adapter(model, "two")
    with pytest.raises(AdapterError, match="must be letters"):
        add_adapter(model, LoraConfig(), "a.b")


def test_save_hf_refuses_a_model_with_adapters(tiny, random_model, tmp_path):
    from plyx.model import CheckpointError, load_hf, save_hf

    model = random_model(tiny())
    add_adapter(model, LoraConfig(r=2, target_modules=("v_proj",), init_lora_weights=False))
    with pytest.raises(CheckpointError, match="merge_and_unload"):
        save_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        want = model(ids)
        save_hf(merge_and_unload(model), tmp_path / "hf")
        torch.testing.assert_close(load_hf(tmp_path / "hf")(ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_decode_on_cuda_honours_the_adapter(tiny, random_model):
    """The Triton kernels of the static step (rmsnorm_linear, swiglu_linear, gemv, rope_store_kv) on CUDA:
    an unmerged adapter is run as modules, a merged one through the packed weights; logits as the eager forward."""
    from plyx.attn import StaticDecode, make_cache

    model = random_model(tiny(d_model=64, n_heads=4, d_ff=128)).cuda()
    add_adapter(model, LoraConfig(r=8, target_modules=ALL, variant="dora", init_lora_weights=False))
    ids = torch.randint(0, 97, (1, 12), device="cuda")
    with torch.inference_mode():
        want = model(ids)
        model.pack_projections_()
        for merged in (False, True):
            if merged:
                merge_adapter(model)
            cache = make_cache("paged", model.config, batch_size=1, max_seq_len=32, dtype=torch.float32, device="cuda")
            got = [model(ids[:, :8], cache=cache, seq_ids=[0])]
            decode = StaticDecode(cache, max_batch=1)
            for t in range(8, 12):
                decode.prepare([0], ids[:, t], 1)
                step_ids, positions, step = decode.inputs(1)
                got.append(model(step_ids, position_ids=positions, kv_step=step))
            # TF32 may be on in the CUDA GEMMs: 1e-3 on logits of size ~10
            torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-3, atol=1e-3)
