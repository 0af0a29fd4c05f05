"""``--format hf`` and ``--format gguf``: read back by their real consumers (transformers, gguf)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from plyx.export import ExportError, ExportVerificationError, export, reference_kernels
from plyx.specs.cli import main

#: a model whose rows are whole q8_0 blocks (d_model 32, d_ff 64) and whose tokenizer is smaller than
#: its embedding (the GGUF token list is padded to vocab_size)
LLAMA = dict(arch="llama", vocab_size=300, d_ff=64, max_seq_len=64)


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_config, checkpoint_with_tokenizer) -> tuple[Path, Any]:
    return checkpoint_with_tokenizer(tiny_config(**LLAMA))


def _plyx_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), reference_kernels():
        return model(ids).float()


# -- hf ------------------------------------------------------------------------------------------
def test_hf_export_loads_in_transformers_with_ids_and_tokenizer(llama_checkpoint, tmp_path: Path,
                                                                hook_recorder) -> None:
    source, model = llama_checkpoint
    out = tmp_path / "hf"
    result = export(model, out, format="hf", source=source)
    names = {p.name for p in result.files}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "plyx_export.json"} <= names
    assert result.verification.ok and result.verification.graph == "hf"

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    # plyx's tokenizer has one special token, <|endoftext|> = 0: bos, eos and pad (Llama's defaults are 1 / 2 / None)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (0, 0, 0)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (0, 0)
    ids = torch.tensor([[5, 17, 200, 3, 9, 41, 8]])
    with torch.no_grad():
        got = hf(ids).logits
    torch.testing.assert_close(got, _plyx_logits(model, ids), atol=1e-4, rtol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    from tokenizers import Tokenizer

    text = "whether 'tis nobler in the mind"
    assert tokenizer(text)["input_ids"] == Tokenizer.from_file(str(source / "tokenizer.json")).encode(text).ids

    (call,) = hook_recorder.calls
    assert call["format"] == "hf" and call["path"] == str(out.absolute())
    assert sorted(call["metadata"]["artifacts"]) == sorted(str(p) for p in out.iterdir())
    assert call["metadata"]["verification"]["ok"]


def test_hf_refuses_what_transformers_cannot_express(tiny_config, random_model, tmp_path: Path) -> None:
    model = random_model(tiny_config(arch="llama", qkv_bias=True))
    with pytest.raises(ExportError, match="format 'hf' cannot express"):
        export(model, tmp_path / "out", format="hf", hooks=False)
    assert not (tmp_path / "out").exists()


# -- gguf ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_gguf_reads_back_in_gguf_and_transformers(outtype: str, llama_checkpoint, tmp_path: Path,
                                                  hook_recorder) -> None:
    source, model = llama_checkpoint
    out = tmp_path / outtype
    result = export(model, out, format="gguf", source=source, outtype=outtype)
    path = out / f"model-{outtype}.gguf"
    assert result.model == path.absolute() and result.verification.ok

    reader = gguf.GGUFReader(str(path))
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("llama.block_count").contents() == model.config.n_layers
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    matrix = "Q8_0" if outtype == "q8_0" else "F16"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == types["output.weight"] == matrix
    assert types["blk.0.attn_norm.weight"] == "F32"
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokens) == model.config.vocab_size and all(tokens[i] == t for t, i in vocab.items())
    assert tokens[-1] == f"[PAD{model.config.vocab_size - 1}]"
    assert reader.get_field("tokenizer.ggml.eos_token_id").contents() == 0

    # transformers' own GGUF loader, on the file alone: logits near the original model's
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 200, 3, 9, 41, 8], [1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        got = hf(ids).logits
    want = _plyx_logits(model, ids)
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= (0.02 if outtype == "f16" else 0.15) * (1 + scale)  # QUANT_TOLERANCES, stated in _gguf.py
    assert err > 0  # the weights really were rounded
    measured = result.settings["quantization_error"]["checks"]  # the exporter's own loss measurement, recorded
    assert len(measured) == 2 and all(m["passed"] and 0 < m["max_abs_error"] for m in measured)
    (call,) = hook_recorder.calls
    assert call["format"] == "gguf" and str(path.absolute()) in call["metadata"]["artifacts"]


def test_gguf_qwen3_with_its_own_head_dim(tiny_config, random_model, tmp_path: Path) -> None:
    model = random_model(tiny_config(arch="qwen3", qk_norm=True, head_dim=16, n_layers=1))
    result = export(model, tmp_path / "q3", format="gguf", hooks=False)
    reader = gguf.GGUFReader(str(result.model))
    assert reader.get_field("general.architecture").contents() == "qwen3"
    assert reader.get_field("qwen3.attention.key_length").contents() == 16
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= {t.name for t in reader.tensors}


def test_gguf_layout_error_is_caught_and_nothing_is_written(llama_checkpoint, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llama.cpp's q/k row permutation the file loads (in gguf and transformers alike) but, read as
    llama.cpp reads it, computes other logits than the model: verification says so."""
    import plyx.export._gguf as gguf_export

    source, model = llama_checkpoint
    monkeypatch.setattr(gguf_export, "permute", lambda w, n_head, n_head_kv: w)
    with pytest.raises(ExportVerificationError, match="far from the original model") as info:
        export(model, tmp_path / "bad", format="gguf", source=source, hooks=False)
    assert "max abs error" in str(info.value) and "layout error" in str(info.value)
    assert not (tmp_path / "bad").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(arch="mistral", sliding_window=4), "has no sliding window"),
    (dict(arch="llama", rope_scaling={"kind": "linear", "factor": 2.0}), "RoPE scaling"),
    (dict(arch="llama", partial_rotary=0.5), "partial rotary"),
    (dict(arch="llama", qkv_bias=True), "q/k/v biases exist only"),
])
def test_gguf_refuses_unsupported_models_before_any_work(overrides: dict[str, Any], message: str, tiny_config,
                                                         random_model, tmp_path: Path) -> None:
    from plyx.specs import ModelConfig

    config = ModelConfig.from_dict({**tiny_config().to_dict(), **overrides})
    with pytest.raises(ExportError, match=message) as info:
        export(random_model(config), tmp_path / "out", format="gguf", hooks=False)
    assert "format 'gguf'" in str(info.value) and config.arch in str(info.value)
    assert not (tmp_path / "out").exists()


def test_cli_gguf_and_hf(llama_checkpoint, tmp_path: Path, capsys, only_export_plugins) -> None:
    source, _ = llama_checkpoint
    assert main(["export", str(source), "--format", "gguf", "--outtype", "q8_0", "--out", str(tmp_path / "g")]) == 0
    assert "model-q8_0.gguf" in capsys.readouterr().out
    # a flag of another format is refused before anything is loaded, naming the flag
    assert main(["export", str(source), "--format", "hf", "--with-kv-cache", "--out", str(tmp_path / "h")]) == 1
    err = capsys.readouterr().err
    assert "does not take --with-kv-cache" in err and not (tmp_path / "h").exists()
    assert main(["export", str(source), "--format", "hf", "--outtype", "q8_0", "--out", str(tmp_path / "h")]) == 1
    assert "does not take --outtype" in capsys.readouterr().err


def test_gguf_refuses_a_tokenizer_it_cannot_hold(tiny_config, random_model, tmp_path: Path) -> None:
    from plyx.model import save_checkpoint

    model = random_model(tiny_config())
    source = save_checkpoint(model, tmp_path / "ckpt", card_fields={"tokenizer": "tokenizer.json"})
    (source / "tokenizer.json").write_text(
        '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}', encoding="utf-8")
    with pytest.raises(ExportError, match="writes byte-level BPE tokenizers") as info:
        export(model, tmp_path / "out", format="gguf", source=source, hooks=False)
    assert "WordLevel" in str(info.value) and not (tmp_path / "out").exists()
