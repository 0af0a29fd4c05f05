"""The KV-cache ONNX graph (Optimum names) and its int8 versions, driven in onnxruntime."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from plyx.export import ExportError, ExportVerificationError, export_onnx, reference_kernels
from plyx.export._verify_kv import KVSession, verify_kv

#: llama (two layers, untied) and mistral with a window shorter than the decode, so the window
#: is exercised across the cache; both GQA. max_seq_len leaves room for a prompt + 64 tokens.
KV_ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", n_layers=2, max_seq_len=80),
    "mistral-window": dict(arch="mistral", sliding_window=6, tie_embeddings=True, n_layers=1, max_seq_len=80),
}


@pytest.fixture(scope="module", params=sorted(KV_ARCHS))
def kv_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_config,
              random_model) -> dict[str, Any]:
    model = random_model(tiny_config(**KV_ARCHS[request.param]), seed=3)
    out = tmp_path_factory.mktemp("kv") / request.param
    result = export_onnx(model, out, with_kv_cache=True, hooks=False)
    return {"model": model, "result": result, "out": out}


def _dims(value: Any) -> list[Any]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_kv_graph_has_optimums_names_and_axes(kv_export: dict[str, Any]) -> None:
    c = kv_export["model"].config
    proto = onnx.load(str(kv_export["result"].model))
    inputs = {v.name: _dims(v) for v in proto.graph.input}
    outputs = {v.name: _dims(v) for v in proto.graph.output}
    want_in = ["input_ids", "attention_mask", "position_ids"]
    want_out = ["logits"]
    for i in range(c.n_layers):
        want_in += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        want_out += [f"present.{i}.key", f"present.{i}.value"]
    assert list(inputs) == want_in and list(outputs) == want_out
    total = "past_sequence_length + sequence_length"
    assert inputs["input_ids"] == inputs["position_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", total]
    assert inputs["past_key_values.0.key"] == ["batch_size", c.kv_heads, "past_sequence_length", c.dim_per_head]
    assert outputs["present.0.value"] == ["batch_size", c.kv_heads, total, c.dim_per_head]
    assert outputs["logits"] == ["batch_size", "sequence_length", c.vocab_size]
    settings = kv_export["result"].settings
    assert settings["with_kv_cache"] is True and [i["name"] for i in settings["inputs"]] == want_in


def test_kv_verification_ran_prefill_decode_and_64_greedy_tokens(kv_export: dict[str, Any]) -> None:
    report = kv_export["result"].verification
    assert report.ok and report.graph == "kv-cache" and len(report.checks) == 2
    assert [(c.batch, c.seq_len) for c in report.checks] == [(1, 5), (3, 11)]
    assert report.greedy is not None and report.greedy.tokens == 64 and report.greedy.passed
    assert report.greedy.onnx == report.greedy.torch


def _plyx_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):  # the model's default kernels (sdpa on CPU): not what the graph was traced with
            seq = torch.cat((seq, model(seq)[:, -1:].argmax(-1)), dim=1)
    return seq[0, len(prompt):].tolist()


def test_greedy_through_the_graph_equals_plyx_with_its_default_kernels(kv_export: dict[str, Any]) -> None:
    """An independent decode loop over the raw session: 64 tokens from a fresh prompt, equal to plyx's."""
    model = kv_export["model"]
    prompt = [7, 3, 64, 12, 99, 0, 41]
    want = _plyx_greedy(model, prompt, 64)
    session = ort.InferenceSession(str(kv_export["result"].model), providers=["CPUExecutionProvider"])
    c = model.config
    past = {f"past_key_values.{i}.{kv}": np.zeros((1, c.kv_heads, 0, c.dim_per_head), np.float32)
            for i in range(c.n_layers) for kv in ("key", "value")}
    ids, got = np.array([prompt], np.int64), []
    for _ in range(64):
        length = len(prompt) + len(got)
        positions = np.arange(length - ids.shape[1], length, dtype=np.int64)[None]
        out = session.run(None, {"input_ids": ids, "attention_mask": np.ones((1, length), np.int64),
                                 "position_ids": positions, **past})
        got.append(int(out[0][0, -1].argmax()))
        past = dict(zip(past, out[1:]))
        ids = np.array([[got[-1]]], np.int64)
    assert got == want


def test_kv_graph_batches_left_padded_rows_like_the_model(kv_export: dict[str, Any]) -> None:
    """Two prompts of different length in one batch, left-padded, decoded 4 steps together."""
    model = kv_export["model"]
    kv = KVSession(kv_export["result"].model)
    ids = torch.tensor([[0, 0, 0, 5, 9, 14], [8, 1, 2, 3, 4, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits, past = kv.step(ids.numpy(), mask.numpy(), positions.numpy(), kv.empty_past(2))
    for _ in range(4):
        nxt = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]  # (2, 1)
        ids, mask = torch.cat((ids, nxt), 1), torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1)
        positions = positions[:, -1:] + 1
        logits, past = kv.step(nxt.numpy(), mask.numpy(), positions.numpy(), past)
    with torch.no_grad(), reference_kernels():
        short = model(ids[:1, 3:])[0, -1]  # the first row without its padding
        long = model(ids[1:])[0, -1]
    np.testing.assert_allclose(logits[0, -1], short.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[1, -1], long.numpy(), atol=1e-4, rtol=1e-4)


def test_kv_verification_catches_a_changed_projection(kv_export: dict[str, Any]) -> None:
    model = copy.deepcopy(kv_export["model"])
    with torch.no_grad():
        model.layers[0].self_attn.v_proj.weight.mul_(1.05)
    with pytest.raises(ExportVerificationError) as info:
        verify_kv(kv_export["result"].model, model, seed=1)
    assert "KV-cache graph disagrees" in str(info.value) and "max abs error" in str(info.value)
    assert not info.value.report.ok


def test_kv_rejects_a_fixed_sequence(tiny_config, random_model, tmp_path: Path) -> None:
    model = random_model(tiny_config())
    with pytest.raises(ExportError, match="cannot be fixed"):
        export_onnx(model, tmp_path / "x", with_kv_cache=True, seq_len=8, hooks=False)
    assert not (tmp_path / "x").exists()


# -- int8 -------------------------------------------------------------------------------------
QUANT_CONFIG = dict(arch="qwen2", qkv_bias=True, tie_embeddings=True, n_layers=1, vocab_size=300, d_ff=64,
                    max_seq_len=80)


@pytest.mark.parametrize("mode", ["int8-dynamic", "int8-static"])
def test_int8_graphs_are_quantised_and_measured(mode: str, tiny_config, checkpoint_with_tokenizer, corpus_text: str,
                                                tmp_path: Path) -> None:
    source, model = checkpoint_with_tokenizer(tiny_config(**QUANT_CONFIG))
    calibration = None
    if mode == "int8-static":
        calibration = tmp_path / "calibration.txt"
        calibration.write_text(corpus_text, encoding="utf-8")
    result = export_onnx(model, tmp_path / mode, source=source, with_kv_cache=True, quantize=mode,
                         calibration=calibration, hooks=False)
    assert not list((tmp_path / mode).glob(".float-*"))  # the float graph is not left behind
    ops = {n.op_type for n in onnx.load(str(result.model)).graph.node}
    if mode == "int8-dynamic":
        assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops
    else:
        assert {"QuantizeLinear", "QLinearMatMul", "DequantizeLinear"} <= ops
        # each layer's down_proj and the LM head stay float (outlier activations; _outlier_inputs)
        assert len(result.settings["quantization"]["kept_float"]) == model.config.n_layers + 1
        calib = result.settings["quantization"]["calibration"]
        assert calib["windows"] >= 1 and calib["tokens_per_window"] > 1
    quality = result.settings["quantization"]["quality"]
    assert result.settings["quantization"]["quantize"] == mode
    assert 0.0 < quality["max_abs_error"] and quality["max_rel_error"] < 1.0  # int8 moves logits, not wildly
    assert quality["top1_agreement"] > 0.5 and quality["greedy"]["tokens"] == 64
    assert result.verification.ok  # the float graph was verified before quantisation
    # the int8 graph still decodes through its cache
    tokens = KVSession(result.model).greedy([1, 2, 3], 8)
    assert len(tokens) == 8 and all(0 <= t < model.config.vocab_size for t in tokens)


def test_quantize_arguments_are_checked_before_any_work(tiny_config, random_model, checkpoint_with_tokenizer,
                                                        tmp_path: Path) -> None:
    model = random_model(tiny_config())
    cases = [
        (dict(quantize="int8-static"), "needs calibration text"),
        (dict(quantize="int8-dynamic", calibration=tmp_path), "takes no calibration"),
        (dict(quantize="int4"), "unknown quantisation mode"),
        (dict(calibration=tmp_path), "only used by --quantize int8-static"),
        (dict(quantize="int8-static", calibration=tmp_path / "missing.txt"), "does not exist"),
        (dict(quantize="int8-dynamic", dtype="float16"), "starts from float32"),
    ]
    for options, message in cases:
        with pytest.raises(ExportError, match=message):
            export_onnx(model, tmp_path / "out", hooks=False, **options)
        assert not (tmp_path / "out").exists()
    text = tmp_path / "calibration.txt"
    text.write_text("some text", encoding="utf-8")
    source, _ = checkpoint_with_tokenizer(tiny_config(**QUANT_CONFIG))
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    with pytest.raises(ExportError, match="has no tokenizer.json"):
        export_onnx(model, tmp_path / "out", hooks=False, quantize="int8-static", calibration=text, source=bare)
