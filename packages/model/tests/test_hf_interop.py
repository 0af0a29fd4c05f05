"""Hugging Face interop with ``transformers`` itself: tiny random models of each family, both directions.

transformers -> save_pretrained -> plyx load: logits for prefill and for
step-by-step decode with each cache kind; plyx -> save_hf -> transformers
from_pretrained: the same logits. float32, tight tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plyx.attn import make_cache  # noqa: E402
from plyx.model import (  # noqa: E402
    CheckpointError,
    UnsupportedArchitectureError,
    load_checkpoint,
    load_hf,
    open_checkpoint,
    save_hf,
)

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, vocab_size=67, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
if int(transformers.__version__.split(".")[0]) >= 5:  # transformers 5 folds theta and scaling into rope_parameters
    LLAMA3 = {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}
else:
    LLAMA3 = {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}
CASES = {
    "llama": ("LlamaConfig", {}),
    "llama-tied-llama3rope": ("LlamaConfig", {"tie_word_embeddings": True, **LLAMA3}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral-window": ("MistralConfig", {"sliding_window": 4}),
    "llama-mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
}
TOL = dict(rtol=1e-5, atol=1e-5)


def hf_model(case: str):
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2).add_(1.0 if p.dim() == 1 else 0.0)  # norms near 1, biases off 0
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    out = {}
    for case in CASES:
        model = hf_model(case)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path)
        out[case] = (model, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_load_transformers_checkpoint_prefill_and_decode(saved, case: str) -> None:
    hf, path = saved[case]
    model = load_checkpoint(path)
    assert model.config.arch == case.split("-")[0]
    ids = torch.randint(0, 67, (2, 12))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids), want, **TOL)
        for kind in ("contiguous", "paged"):
            cache = make_cache(kind, model.config, batch_size=2, block_size=4)
            steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
            torch.testing.assert_close(torch.cat(steps, 1), want, **TOL, msg=lambda m, kind=kind: f"{kind}: {m}")


@pytest.mark.parametrize("case", ["llama-tied-llama3rope", "qwen2", "qwen3", "mistral-window"])
def test_save_hf_loads_in_transformers(saved, tmp_path: Path, case: str) -> None:
    hf, path = saved[case]
    model = load_hf(path)
    out = save_hf(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids = torch.randint(0, 67, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, **TOL)
    # and back into plyx: the same config
    assert load_hf(out).config == model.config


def test_hf_decode_with_generate_matches(saved) -> None:
    """Greedy continuation by transformers' own generate equals plyx's cached greedy loop."""
    hf, path = saved["qwen3"]
    model = load_checkpoint(path)
    prompt = torch.randint(0, 67, (1, 6))
    with torch.no_grad():
        # an explicit mask: otherwise generate() takes every token equal to pad_token_id for padding
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, 6:]
        cache = make_cache("paged", model.config, block_size=4)
        logits = model(prompt, cache=cache)
        got = []
        for _ in range(8):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            got.append(nxt.item())
            logits = model(nxt, cache=cache)
    assert got == want.tolist()


def test_sharded_hf_checkpoint(tmp_path: Path) -> None:
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = open_checkpoint(tmp_path)
    assert len(ckpt.shards()) > 1 and ckpt.card.layout == "hf"
    ids = torch.randint(0, 67, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path)(ids), hf(ids).logits, **TOL)


def _write_config(path: Path, **changes) -> None:
    doc = json.loads((path / "config.json").read_text())
    doc.update(changes)
    (path / "config.json").write_text(json.dumps(doc))


def test_unknown_architecture_names_the_supported_ones(saved, tmp_path: Path) -> None:
    _, src = saved["llama"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="'gpt_neox'.*'llama', 'qwen2', 'qwen3', 'mistral'"):
        load_checkpoint(tmp_path)


def test_unsupported_features_and_pickle_only_dirs(saved, tmp_path: Path) -> None:
    _, src = saved["llama"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, mlp_bias=True)
    with pytest.raises(CheckpointError, match="mlp_bias"):
        open_checkpoint(tmp_path)
    _write_config(tmp_path, mlp_bias=False)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files, which plyx never loads"):
        open_checkpoint(tmp_path)


def test_config_mismatch_names_tensor_and_both_shapes(saved, tmp_path: Path) -> None:
    _, src = saved["qwen2"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, vocab_size=70)
    with pytest.raises(CheckpointError, match=r"'embed_tokens.weight': checkpoint shape \[67, 32\] vs model shape \[70, 32\]"):
        load_checkpoint(tmp_path)


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path: Path) -> None:
    hf = hf_model("qwen2").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.config.dtype == "bfloat16" and open_checkpoint(tmp_path).card.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 67, (1, 8))
    with torch.no_grad():
        # same bf16 weights; both compute in bf16 with float32 norms: differences are bf16 rounding
        torch.testing.assert_close(model(ids), hf(ids).logits.float(), rtol=2e-2, atol=5e-2)
    assert load_checkpoint(tmp_path, dtype="float32").embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(arch="qwen2", qkv_bias=False), "without q/k/v biases"),
        (dict(arch="llama", qkv_bias=True), "use arch='qwen2'"),
        (dict(arch="llama", qk_norm=True), "QK-norm exists exactly in qwen3"),
        (dict(arch="llama", sliding_window=8), "use arch='mistral'"),
    ],
)
def test_save_hf_refuses_what_transformers_cannot_express(tmp_path: Path, tiny, overrides, match: str) -> None:
    from plyx.model import TransformerLM

    with pytest.raises(CheckpointError, match=match):
        save_hf(TransformerLM(tiny(**overrides)), tmp_path / "x")
    assert not (tmp_path / "x").exists()
