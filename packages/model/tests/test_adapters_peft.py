"""PEFT interop with ``peft`` itself as the oracle, both directions, for lora, rslora and dora.

plyx adapter -> ``save_peft`` -> ``peft.PeftModel.from_pretrained`` on the transformers twin (``save_hf``):
the same logits. ``peft.get_peft_model`` adapter -> ``save_pretrained`` -> ``load_peft`` on ``load_hf``: the
same logits. float32 throughout; the tolerance (1e-5) is the one plyx's plain HF interop tests use: the two
stacks sum the same products in different orders (fused kernels vs torch ops), ~1e-7 relative per op.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from plyx.model import load_hf, save_hf  # noqa: E402
from plyx.model.adapters import (  # noqa: E402
    AdapterError,
    AdapterMismatchError,
    LoraConfig,
    LoraLinear,
    active_adapter,
    add_adapter,
    list_adapters,
    load_peft,
    save_peft,
)

TOL = dict(rtol=1e-5, atol=1e-5)
FLAGS = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True}}


def _perturb(model) -> None:
    """Non-trivial adapters: random B (init_lora_weights=False gives that) and DoRA magnitudes off the norms."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.rand_like(p))


@pytest.mark.parametrize("variant", list(FLAGS))
@pytest.mark.parametrize("targets", [("q_proj", "v_proj", "down_proj"), ("re:layers\\.1\\..*(o|up)_proj",)])
def test_save_peft_loads_in_peft_with_equal_logits(tiny, random_model, tmp_path, variant, targets):
    model = random_model(tiny(qkv_bias=True, arch="qwen2"))
    save_hf(model, tmp_path / "base")
    add_adapter(model, LoraConfig(r=4, alpha=12, target_modules=targets, variant=variant, init_lora_weights=False))
    _perturb(model)
    save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    doc = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert doc["use_dora"] is (variant == "dora") and doc["use_rslora"] is (variant == "rslora")

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float()
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).eval()
    adapted = [n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    ours = ["base_model.model.model." + p for p, m in model.named_modules() if isinstance(m, LoraLinear)]
    assert sorted(adapted) == sorted(ours)  # peft adapted exactly the modules we did
    ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad(), hf.disable_adapter():
        plain = hf(ids).logits
    want, got = hf(ids).logits, model(ids)
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the logits: the comparison means something
    torch.testing.assert_close(got, want, **TOL)
    # gradients too: DoRA's detached weight norm changes only the backward pass
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in hf.named_parameters() if "lora_" in n}
    for path, layer in ((p, m) for p, m in model.named_modules() if isinstance(m, LoraLinear)):
        for key, param in layer.adapter_tensors("default").items():
            name = f"base_model.model.model.{path}.{key}"
            name = name if name in theirs else name + ".weight"  # peft's magnitude is a module's .weight
            # gradients reach ~100 here (sums over 26 positions x 97 logits): float32 rounding of the two
            # stacks' different summation orders is judged relative to the largest (measured: ~3e-7 of it)
            scale = float(theirs[name].abs().max())
            torch.testing.assert_close(param.grad, theirs[name], rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("variant", "targets"), [
    *[(v, ["k_proj", "o_proj", "gate_proj"]) for v in FLAGS],
    ("lora", "all-linear"),
    ("dora", r"model\.layers\.1\.(self_attn\.q|mlp\.down)_proj"),
])
def test_load_peft_made_by_peft_with_equal_logits(tmp_path, variant, targets):
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, vocab_size=67)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2).add_(1.0 if p.dim() == 1 else 0.0)
    hf.save_pretrained(tmp_path / "base")
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                           init_lora_weights=False, **FLAGS[variant])
    pm = peft.get_peft_model(hf, lcfg).eval()
    _perturb(pm)
    pm.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 67, (2, 10))
    with torch.no_grad():
        want = pm(ids).logits

    model = load_hf(tmp_path / "base").eval()
    load_peft(model, tmp_path / "adapter", name="tuned")
    assert list_adapters(model) == ["tuned"] and active_adapter(model) == "tuned"
    adapted = sorted(n.removeprefix("base_model.model.model.") for n, m in pm.named_modules()
                     if hasattr(m, "lora_A") and "default" in m.lora_A)
    assert sorted(p for p, m in model.named_modules() if isinstance(m, LoraLinear)) == adapted
    assert {m.variants["tuned"].name for m in model.modules() if isinstance(m, LoraLinear)} == {variant}
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, **TOL)


def test_adapter_of_another_model_is_refused_by_tensor_and_shape(tiny, random_model, tmp_path):
    other = random_model(tiny(d_ff=40))
    add_adapter(other, LoraConfig(r=4, target_modules=("up_proj",)))
    save_peft(other, tmp_path / "adapter")
    model = random_model(tiny())
    with pytest.raises(AdapterMismatchError, match=r"layers\.0\.mlp\.up_proj\.lora_B\.weight: file \[40, 4\] vs "
                                                   r"model \[48, 4\]") as err:
        load_peft(model, tmp_path / "adapter")
    assert len(err.value.problems) == 2  # one per layer
    assert list_adapters(model) == [] and not any(isinstance(m, LoraLinear) for m in model.modules())


def test_bad_adapter_directories_are_named(tiny, random_model, tmp_path):
    model = random_model(tiny())
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft(model, tmp_path)
    add_adapter(model, LoraConfig(r=2))
    out = save_peft(model, tmp_path / "a")
    doc = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**doc, "bias": "all"}))
    fresh = random_model(tiny())
    with pytest.raises(AdapterError, match="bias='all' is not supported"):
        load_peft(fresh, out)
    (out / "adapter_config.json").write_text(json.dumps({**doc, "peft_type": "IA3"}))
    with pytest.raises(AdapterError, match="peft_type 'IA3'"):
        load_peft(fresh, out)
    (out / "adapter_model.safetensors").rename(out / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        load_peft(fresh, out)
    assert list_adapters(fresh) == []
