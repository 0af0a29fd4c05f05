"""ONNX export of a plyx ``TransformerLM``: the prefill graph ``input_ids [B, T] -> logits [B, T, V]``,
or (``with_kv_cache``) the decoding graph of ``_kv.py``, optionally quantised to int8 (``_quantize.py``).

The graph is traced with ``torch.onnx.export(..., dynamo=True)`` (``torch.export``
then onnxscript). The TorchScript exporter cannot be used: it has no ONNX
symbolic for the in-place boolean ``&=`` the reference attention builds its
causal mask with (``aten::__iand_``), while the dynamo exporter functionalises
it. Batch and sequence are dynamic axes (``batch``, ``sequence``) unless
``seq_len`` fixes T. Positions are ``0..T-1`` in every row: no padding mask and
no KV cache (a prefill / scoring graph). The decoding graph has Optimum's
inputs and axes instead (see ``_kv.py``) and is checked by ``verify_kv``.

Files written into the (temporary) export directory:

- ``model.onnx`` (+ ``model.onnx.data`` when the weights pass the 2 GiB protobuf limit)
- ``config.json``: the Hugging Face config of the architecture, as optimum writes it
  (left out for the few plyx configs transformers cannot express)
- ``plyx_export.json``: the plyx ``ModelConfig``, the source checkpoint's card,
  the graph signature, exporter versions and the verification figures
- the source checkpoint's tokenizer files, when it has them
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from plyx.export._deps import require, version_of
from plyx.export._errors import ExportError
from plyx.export._kernels import REFERENCE_IMPL, reference_kernels
from plyx.export._kv import KVDecoder, kv_input_names, kv_output_names
from plyx.export._quantize import check_quantize, measure_quantized, quantize_graph
from plyx.export._result import ExportResult
from plyx.export._verify import default_shapes, verify_onnx
from plyx.export._verify_kv import DEFAULT_GREEDY_TOKENS, verify_kv
from torch import nn

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_OPSET",
    "MANIFEST_FILE",
    "MIN_OPSET",
    "MODEL_FILE",
    "TOKENIZER_FILES",
    "write_onnx",
]

DEFAULT_OPSET = 18  # the dynamo exporter's native opset; onnxruntime >= 1.14 runs it
MIN_OPSET = 18  # lower opsets go through onnx's version converter, which fails on these graphs
MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "plyx_export.json"
MANIFEST_SCHEMA = "plyx-export/onnx"  # the schema name predates other formats; "export.format" tells them apart
MANIFEST_VERSION = 1
#: the KV graph's attention_mask / present sequence axis, as Optimum names it
TOTAL_AXIS = "past_sequence_length + sequence_length"
#: Hugging Face tokenizer files copied from a source checkpoint when present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
_EXTERNAL_DATA_BYTES = 1 << 30  # well under protobuf's 2 GiB message limit
_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_EXAMPLE_BATCH, _EXAMPLE_SEQ = 2, 7  # traced example; distinct so torch.export keeps B and T separate


class _Prefill(nn.Module):
    """The exported signature: token ids in, float32 logits out (positions 0..T-1, no cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)  # (B, T, V) float32


def write_onnx(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    seq_len: int | None = None,
    opset: int = DEFAULT_OPSET,
    dtype: str | torch.dtype = "float32",
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    source: str | os.PathLike[str] | None = None,
    with_kv_cache: bool = False,
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
    quantize: str | None = None,
    calibration: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Write the ONNX export of ``model`` into ``out_dir`` (the ``onnx`` exporter's factory).

    ``out_dir`` is written in place; ``plyx.export.export_onnx`` calls this on a
    temporary directory and renames it when complete. Arguments as ``export_onnx``.
    """
    from plyx.model import TransformerLM

    if not isinstance(model, TransformerLM):
        raise ExportError("model", f"expected a plyx.model.TransformerLM, got {type(model).__name__}",
                          fix="load one with plyx.model.load_checkpoint(path)")
    onnx = require("onnx")
    require("onnxscript")
    config = model.config
    target = _check_dtype(dtype)
    opset = _check_opset(opset, onnx)
    seq_len = _check_seq_len(seq_len, config.max_seq_len)
    if with_kv_cache and seq_len is not None:
        raise ExportError("seq_len", "a KV-cache graph grows its sequence axis every step, so it cannot be fixed",
                          value=seq_len, fix="drop --seq-len, or export without --with-kv-cache")
    source_dir = _check_source(source)
    check_quantize(quantize, calibration, source_dir)
    if quantize is not None and target != torch.float32:
        raise ExportError("quantize", f"int8 quantisation starts from float32 weights, not {_name(target)}",
                          value=quantize, fix="drop --dtype (float32 is the default)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with _as_dtype(model, target) as prepared:
        if with_kv_cache:
            graph_path, external = _trace_kv(prepared, out, opset=opset)
        else:
            graph_path, external = _trace_and_save(prepared, out, seq_len=seq_len, opset=opset)
        onnx.checker.check_model(str(graph_path))  # by path, so external data is checked too
        report = None
        if verify:
            shapes = default_shapes(config.max_seq_len, seq_len)
            if with_kv_cache:
                report = verify_kv(graph_path, prepared, shapes=shapes, atol=atol, rtol=rtol,
                                   greedy_tokens=greedy_tokens)
            else:
                report = verify_onnx(graph_path, prepared, shapes=shapes, atol=atol, rtol=rtol)
        quantization = None
        if quantize is not None:
            graph_path, external, quantization = _quantize_in_place(
                graph_path, external, prepared, quantize, calibration, source_dir,
                greedy_tokens=greedy_tokens if with_kv_cache else 0)

    files = [graph_path] + ([external] if external else [])
    config_path = _write_hf_config(out, config)
    if config_path is not None:
        files.append(config_path)
    tokenizer = _copy_tokenizer(source_dir, out)
    files += tokenizer
    settings = {
        "format": "onnx",
        "opset": opset,
        "dtype": _name(target),
        "seq_len": seq_len,
        **(_kv_signature(config) if with_kv_cache else _prefill_signature(config, seq_len)),
        "kernels": REFERENCE_IMPL,
        "external_data": external.name if external else None,
        "quantization": quantization,
    }
    manifest = out / MANIFEST_FILE
    manifest.write_text(json.dumps(_manifest(config, settings, source_dir, report), indent=2) + "\n", encoding="utf-8")
    files.append(manifest)
    return ExportResult(format="onnx", path=out, files=files, model=graph_path, config=config_path,
                        manifest=manifest, tokenizer=tokenizer, verification=report, settings=settings)


def _prefill_signature(config: Any, seq_len: int | None) -> dict[str, Any]:
    t = seq_len or "sequence"
    return {"with_kv_cache": False,
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", t]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", t, config.vocab_size]}],
            "graph": "prefill: positions 0..T-1 per row, no attention mask, no KV cache"}


def _kv_signature(config: Any) -> dict[str, Any]:
    kv = ["batch_size", config.kv_heads, "past_sequence_length", config.dim_per_head]
    total = ["batch_size", config.kv_heads, TOTAL_AXIS, config.dim_per_head]
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch_size", "sequence_length"]},
              {"name": "attention_mask", "dtype": "int64", "shape": ["batch_size", TOTAL_AXIS]},
              {"name": "position_ids", "dtype": "int64", "shape": ["batch_size", "sequence_length"]}]
    inputs += [{"name": n, "dtype": "float", "shape": kv} for n in kv_input_names(config.n_layers)[3:]]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch_size", "sequence_length", config.vocab_size]}]
    outputs += [{"name": n, "dtype": "float", "shape": total} for n in kv_output_names(config.n_layers)[1:]]
    return {"with_kv_cache": True, "inputs": inputs, "outputs": outputs,
            "graph": "decoder with past: past_key_values.N.key/value in, present.N.key/value out (Optimum / "
                     "onnxruntime-genai names); an empty past (length 0) is the prefill"}


def _quantize_in_place(graph: Path, external: Path | None, model: nn.Module, mode: str,
                       calibration: str | os.PathLike[str] | None, source: Path | None, *, greedy_tokens: int
                       ) -> tuple[Path, Path | None, dict[str, Any]]:
    """Quantise the verified float graph; ``model.onnx`` becomes the int8 graph and the float one is removed."""
    float_graph = graph.with_name(f".float-{graph.name}")
    os.replace(graph, float_graph)
    if external is not None:
        os.replace(external, external.with_name(f".float-{external.name}"))
    tokenizer_file = None if source is None else source / "tokenizer.json"
    settings = quantize_graph(float_graph, graph, mode, calibration=calibration, tokenizer_file=tokenizer_file)
    for leftover in graph.parent.glob(".float-*"):
        leftover.unlink()
    settings["quality"] = measure_quantized(graph, model, greedy_tokens=greedy_tokens)
    data = graph.with_name(f"{graph.name}.data")
    return graph, (data if data.exists() else None), settings


# -- checks ------------------------------------------------------------------------------
def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = _name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    if name not in _DTYPES:
        why = " (onnxruntime's CPU provider has no bfloat16 kernels for these ops)" if name == "bfloat16" else ""
        raise ExportError("dtype", f"cannot export weights as {name}{why}", value=name,
                          fix=f"use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _check_opset(opset: int, onnx: Any) -> int:
    newest = int(onnx.defs.onnx_opset_version())
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= newest:
        raise ExportError("opset", f"must be an integer from {MIN_OPSET} to {newest} (the newest this onnx knows)",
                          value=opset, fix=f"use the default {DEFAULT_OPSET}")
    return opset


def _check_seq_len(seq_len: int | None, max_seq_len: int) -> int | None:
    if seq_len is None:
        return None if max_seq_len > 1 else 1  # a dynamic axis needs room for two sizes
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 1 <= seq_len <= max_seq_len:
        raise ExportError("seq_len", f"must be an integer from 1 to the model's max_seq_len {max_seq_len}",
                          value=seq_len, fix="leave it unset for a dynamic sequence axis")
    return seq_len


def _check_source(source: str | os.PathLike[str] | None) -> Path | None:
    if source is None:
        return None
    path = Path(source)
    if not path.is_dir():
        raise ExportError("source", f"checkpoint directory {str(path)!r} does not exist", value=str(source),
                          fix="pass the directory the model was loaded from, or leave source unset")
    return path


@contextlib.contextmanager
def _as_dtype(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """The model in eval mode with ``dtype`` weights: itself (mode restored after), or a converted copy."""
    if all(p.dtype == dtype for p in model.parameters()):
        was_training = model.training
        try:
            yield model.eval()
        finally:
            model.train(was_training)
    else:
        yield copy.deepcopy(model).to(dtype).eval()  # the caller's model keeps its dtype


# -- tracing -----------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence what torch.onnx prints about optional packages and deprecations (not about the model)."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # the KV graph's axes share constraints by design (one batch axis over every input)
            warnings.filterwarnings("ignore", message="# The axis name", category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _trace_and_save(model: nn.Module, out: Path, *, seq_len: int | None, opset: int) -> tuple[Path, Path | None]:
    config = model.config
    batch = torch.export.Dim("batch", min=1)
    if seq_len is None:
        example_t = min(_EXAMPLE_SEQ, config.max_seq_len)
        example_b = _EXAMPLE_BATCH if example_t != _EXAMPLE_BATCH else _EXAMPLE_BATCH + 1
        dynamic = {"input_ids": {0: batch, 1: torch.export.Dim("sequence", min=1, max=config.max_seq_len)}}
    else:
        example_t, example_b = seq_len, _EXAMPLE_BATCH if seq_len != _EXAMPLE_BATCH else _EXAMPLE_BATCH + 1
        dynamic = {"input_ids": {0: batch}}
    device = next(model.parameters()).device
    example = torch.zeros(example_b, example_t, dtype=torch.long, device=device)  # (B, T)
    program = _export_program(_Prefill(model).eval(), (example,), dynamic, opset, ["input_ids"], ["logits"])
    return _save(program, model, out)


def _export_program(module: nn.Module, args: tuple[Any, ...], dynamic: Any, opset: int, input_names: list[str],
                    output_names: list[str]) -> Any:
    try:
        with reference_kernels(), torch.no_grad(), _quiet_exporter():
            return torch.onnx.export(
                module, args, dynamo=True, input_names=input_names, output_names=output_names,
                dynamic_shapes=dynamic, opset_version=opset, optimize=True, verbose=False,
            )
    except ExportError:
        raise
    except Exception as exc:  # torch.export and onnxscript raise many error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ExportError("model", f"torch.onnx.export (dynamo) failed: {type(exc).__name__}: {first}",
                          fix="the model's forward must trace with torch.export; run with TORCH_LOGS=+export "
                              "for the full trace") from exc


def _save(program: Any, model: nn.Module, out: Path) -> tuple[Path, Path | None]:
    path = out / MODEL_FILE
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = weight_bytes > _EXTERNAL_DATA_BYTES
    program.save(str(path), external_data=external)
    data = out / f"{MODEL_FILE}.data"
    return path, (data if external and data.exists() else None)


def _trace_kv(model: nn.Module, out: Path, *, opset: int) -> tuple[Path, Path | None]:
    """Trace ``KVDecoder`` with batch, new tokens and past length dynamic; name the axes as Optimum does."""
    config = model.config
    n = config.n_layers
    batch = torch.export.Dim("batch_size", min=1)
    new = torch.export.Dim("sequence_length", min=1, max=config.max_seq_len)
    past_len = torch.export.Dim("past_sequence_length", min=0, max=config.max_seq_len)
    # the mask's length is past + new; torch.export cannot name a sum of two dims, so it is left to infer
    dynamic = ({0: batch, 1: new}, {0: batch, 1: torch.export.Dim.DYNAMIC}, {0: batch, 1: new},
               tuple({0: batch, 2: past_len} for _ in range(2 * n)))
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    B, P, T = 2, 3, 4  # distinct, so no two axes are unified by accident
    ids = torch.zeros(B, T, dtype=torch.long, device=device)  # (B, T)
    mask = torch.ones(B, P + T, dtype=torch.long, device=device)  # (B, P + T)
    positions = torch.arange(P, P + T, device=device).expand(B, T)  # (B, T)
    past = tuple(torch.zeros(B, config.kv_heads, P, config.dim_per_head, dtype=dtype, device=device)
                 for _ in range(2 * n))  # (B, KV, P, Dh) each
    program = _export_program(KVDecoder(model).eval(), (ids, mask, positions, *past), dynamic, opset,
                              kv_input_names(n), kv_output_names(n))
    path, external = _save(program, model, out)
    _name_total_axis(path)
    return path, external


def _name_total_axis(path: Path) -> None:
    """Give the mask's inferred axis (``s53``...) Optimum's name; the presents already carry it."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)  # external data stays where it is
    for value in proto.graph.input:
        if value.name == "attention_mask":
            dim = value.type.tensor_type.shape.dim[1]
            if dim.dim_param:
                dim.dim_param = TOTAL_AXIS
    onnx.save(proto, str(path))


# -- side files ----------------------------------------------------------------------------
def _write_hf_config(out: Path, config: Any) -> Path | None:
    from plyx.model import config_to_hf

    try:
        hf = config_to_hf(config)
    except ValueError:
        return None  # transformers has no such architecture (e.g. llama with q/k/v biases)
    path = out / CONFIG_FILE
    path.write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return path


def _card_of(source: Path | None) -> dict[str, Any] | None:
    if source is None:
        return None
    from plyx.model import CheckpointError, open_checkpoint

    try:
        card = open_checkpoint(source).card.to_dict()
    except CheckpointError:
        return None
    card.pop("tensors", None)  # per-tensor shapes of the checkpoint say nothing about the graph
    return card


def _copy_tokenizer(source: Path | None, out: Path) -> list[Path]:
    if source is None:
        return []
    names = list(TOKENIZER_FILES)
    card = _card_of(source)
    named = (card or {}).get("tokenizer") or ""
    if named and named not in names:
        names.insert(0, named)
    copied = []
    for name in names:
        src = source / name
        if src.is_file():
            dest = out / Path(name).name
            shutil.copyfile(src, dest)
            copied.append(dest)
    return copied


def _manifest(config: Any, settings: dict[str, Any], source: Path | None, report: Any, *,
              exporter: str = "torch.onnx.export(dynamo=True)", packages: tuple[str, ...] = ("onnx", "onnxscript",
                                                                                            "onnxruntime")
              ) -> dict[str, Any]:
    planes = ("plyx-specs", "plyx-kernel", "plyx-attn", "plyx-model", "plyx-export")
    return {
        "schema": MANIFEST_SCHEMA,
        "version": MANIFEST_VERSION,
        "export": settings,
        "model": config.to_dict(),
        "source": None if source is None else {"path": str(source.resolve()), "card": _card_of(source)},
        "exporter": {"name": exporter, **{d: version_of(d) for d in ("torch", *packages)}},
        "producers": {d: version_of(d) for d in planes},
        "verification": None if report is None else report.to_dict(),
    }
