"""ONNX exports of tiny random models of each architecture, run in onnxruntime at several shapes."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest
import torch
from plyx.export import (
    ExportError,
    ExportResult,
    ExportVerificationError,
    export_onnx,
    reference_kernels,
    verify_onnx,
)

#: one tiny model per architecture feature the model plane supports; GQA everywhere (n_kv_heads < n_heads)
#: (one layer where the feature is per layer; llama keeps two so layer stacking is exported too)
ARCHS: dict[str, dict[str, Any]] = {
    "llama-untied": dict(arch="llama", tie_embeddings=False, n_layers=2),
    "qwen2-bias-tied": dict(arch="qwen2", qkv_bias=True, tie_embeddings=True, n_layers=1),
    "qwen3-qknorm-untied": dict(arch="qwen3", qk_norm=True, head_dim=16, tie_embeddings=False, n_layers=1),
    "mistral-window-tied": dict(arch="mistral", sliding_window=4, tie_embeddings=True, n_layers=1),
}


def _ort_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"input_ids": ids.numpy()})[0])


def _assert_close(got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float) -> None:
    """Scale-relative closeness: the criterion verify_onnx uses (max|diff| <= atol + rtol * max|want|)."""
    assert got.shape == want.shape
    err = float((got.double() - want.double()).abs().max())
    assert err <= atol + rtol * float(want.abs().max()), f"max abs error {err}"


@pytest.fixture(scope="module", params=sorted(ARCHS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_config,
             random_model) -> dict[str, Any]:
    name = request.param
    model = random_model(tiny_config(**ARCHS[name]))
    out = tmp_path_factory.mktemp("onnx") / name
    result = export_onnx(model, out, hooks=False)  # the hook is tested in test_cli / test_atomic_and_hooks
    return {"name": name, "model": model, "result": result, "out": out}


def test_export_writes_the_graph_and_side_files(exported: dict[str, Any]) -> None:
    result: ExportResult = exported["result"]
    out: Path = exported["out"]
    assert result.path == out.absolute() and result.model == out.absolute() / "model.onnx"
    assert {p.name for p in result.files} == {"model.onnx", "config.json", "plyx_export.json"}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in result.files)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary directory left"
    assert os.environ.get("PLYX_KERNELS") is None, "the kernel override leaked out of the export"


def test_graph_signature_has_dynamic_batch_and_sequence(exported: dict[str, Any]) -> None:
    graph = onnx.load(str(exported["result"].model)).graph
    vocab = exported["model"].config.vocab_size
    (inp,), (out,) = graph.input, graph.output
    assert inp.name == "input_ids" and inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert out.name == "logits" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    dims = out.type.tensor_type.shape.dim
    assert [d.dim_param for d in dims[:2]] == ["batch", "sequence"] and dims[2].dim_value == vocab


def test_built_in_verification_checked_two_shapes(exported: dict[str, Any]) -> None:
    report = exported["result"].verification
    assert report is not None and report.ok and report.dtype == "float32"
    assert len({(c.batch, c.seq_len) for c in report.checks}) == 2
    for check in report.checks:
        assert check.max_abs_error < 1e-4 and check.max_abs_logit > 0.1  # logits far from trivially zero


@pytest.mark.parametrize("shape", [(2, 3), (4, 17)])
def test_onnxruntime_matches_torch_with_its_default_kernels(exported: dict[str, Any], shape: tuple[int, int]) -> None:
    """Fresh ids, shapes other than the traced and verified ones; torch runs with its usual kernels (sdpa)."""
    model = exported["model"]
    ids = torch.randint(0, model.config.vocab_size, shape)
    with torch.no_grad():
        want = model(ids)
    _assert_close(_ort_logits(exported["result"].model, ids), want, atol=1e-4, rtol=1e-4)


def test_reference_kernels_are_selected_only_inside_the_block() -> None:
    from plyx.kernel import query_for, registry

    q = torch.randn(1, 4, 2, 8)
    query = query_for("attention", q, q, q)
    outside = registry().select("attention", query).impl
    with reference_kernels() as forced:
        assert forced["attention"] == "reference"
        assert registry().select("attention", query).impl == "reference"
        assert registry().select("rmsnorm", query_for("rmsnorm", q)).impl == "reference"
    assert registry().select("attention", query).impl == outside


def test_verification_rejects_a_graph_that_differs_from_the_model(exported: dict[str, Any]) -> None:
    other = copy.deepcopy(exported["model"])
    with torch.no_grad():
        other.layers[0].mlp.down_proj.weight.mul_(1.05)  # a 5% change in one projection
    with pytest.raises(ExportVerificationError) as info:
        verify_onnx(exported["result"].model, other, seed=3)
    message = str(info.value)
    assert "max abs error" in message and "seed 3" in message and "atol" in message
    assert not info.value.report.ok
    report = verify_onnx(exported["result"].model, other, seed=3, raise_on_failure=False)
    assert report.max_abs_error == info.value.report.max_abs_error  # same seed, same ids, same figures
    assert verify_onnx(exported["result"].model, exported["model"], seed=3).ok


def test_static_seq_len_float16_export_leaves_the_model_untouched(tmp_path: Path, tiny_config, random_model) -> None:
    model = random_model(tiny_config(arch="llama", n_layers=1)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = export_onnx(model, tmp_path / "fp16", seq_len=6, dtype="float16", hooks=False)
    graph = onnx.load(str(result.model)).graph
    assert [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim] == ["batch", 6]
    assert {i.data_type for i in graph.initializer if i.dims and len(i.dims) == 2} == {onnx.TensorProto.FLOAT16}
    report = result.verification
    assert report.ok and report.dtype == "float16" and {c.seq_len for c in report.checks} == {6}
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(0, 101, (3, 6))
    with torch.no_grad():
        want = model.eval()(ids)
    _assert_close(_ort_logits(result.model, ids), want, atol=5e-2, rtol=2e-2)  # float16 weights vs float32 torch
    with pytest.raises(Exception, match="invalid dimensions"):  # T is fixed: onnxruntime refuses another length
        _ort_logits(result.model, torch.randint(0, 101, (3, 7)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"opset": 12}, "opset"),
        ({"seq_len": 33}, "seq_len"),
        ({"seq_len": 0}, "seq_len"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_bad_arguments_are_named_and_nothing_is_written(tmp_path: Path, kwargs: dict[str, Any], field: str,
                                                        tiny_config, random_model) -> None:
    model = random_model(tiny_config(n_layers=1))
    with pytest.raises(ExportError) as info:
        export_onnx(model, tmp_path / "out", **kwargs)
    assert info.value.field == field and field in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither the destination nor a temporary directory


def test_a_model_that_is_not_a_transformer_lm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="TransformerLM"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_from_a_hugging_face_directory_carries_its_tokenizer(tmp_path: Path, tiny_config,
                                                                     random_model) -> None:
    """No verification this time: the result says so, and onnxruntime is checked here instead."""
    from plyx.model import load_hf, save_hf

    hf_dir = save_hf(random_model(tiny_config(arch="qwen2", qkv_bias=True, n_layers=1), seed=2), tmp_path / "hf")
    (hf_dir / "tokenizer_config.json").write_text('{"model_max_length": 32}', encoding="utf-8")
    model = load_hf(hf_dir)
    result = export_onnx(model, tmp_path / "out", source=hf_dir, verify=False, hooks=False)
    assert result.verification is None
    assert [p.name for p in result.tokenizer] == ["tokenizer_config.json"]
    assert (tmp_path / "out" / "tokenizer_config.json").read_bytes() == (hf_dir / "tokenizer_config.json").read_bytes()
    manifest = (tmp_path / "out" / "plyx_export.json").read_text(encoding="utf-8")
    assert '"layout": "hf"' in manifest and '"verification": null' in manifest
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(ids)
    _assert_close(_ort_logits(result.model, ids), want, atol=1e-4, rtol=1e-4)
