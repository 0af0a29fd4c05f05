"""int8 ONNX graphs through ``onnxruntime.quantization``: dynamic, or static with text calibration.

- ``int8-dynamic``: ``quantize_dynamic``: int8 per-channel weights, activations
  quantised on the fly per call (no calibration).
- ``int8-static``: ``quantize_static`` (QOperator format, ``QLinearMatMul``): int8
  per-channel weights and uint8 activations with ranges from calibration batches. The batches are windows
  of a text file tokenised with the model's own tokenizer (``tokenizer.json`` of
  the source checkpoint, read with ``tokenizers``), fed through the graph's real
  inputs (an empty past for the KV graph).

Only ``MatMul``/``Gemm`` nodes with a weight (an initializer input) are quantised
(int8-static also keeps ``down_proj`` and the LM head float: ``_outlier_inputs``):
the projections hold the weights. Attention's activation-by-activation products
(q·kᵀ, softmax·v), softmax, norms and RoPE stay float: quantising them costs
accuracy (int8 attention scores flip greedy tokens) and saves no bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from plyx.export._deps import require
from plyx.export._errors import ExportError

__all__ = ["QUANTIZE_MODES", "calibration_batches", "check_quantize", "quantize_graph"]

QUANTIZE_MODES = ("int8-dynamic", "int8-static")
_OPS = ["MatMul", "Gemm"]
#: calibration: this many windows of this many tokens (MinMax ranges settle after a few thousand tokens)
CALIBRATION_WINDOWS, CALIBRATION_TOKENS = 16, 64


def check_quantize(quantize: str | None, calibration: str | os.PathLike[str] | None,
                   source: str | os.PathLike[str] | None) -> None:
    """Refuse a bad ``quantize``/``calibration`` combination before any work."""
    if quantize is None:
        if calibration is not None:
            raise ExportError("calibration", "a calibration file is only used by --quantize int8-static",
                              value=str(calibration), fix="add --quantize int8-static, or drop --calibration")
        return
    if quantize not in QUANTIZE_MODES:
        raise ExportError("quantize", "unknown quantisation mode", value=quantize,
                          fix=f"use one of {', '.join(QUANTIZE_MODES)}")
    if quantize == "int8-static":
        if calibration is None:
            raise ExportError("calibration", "int8-static needs calibration text to measure activation ranges",
                              fix="pass --calibration FILE (plain text, tokenised with the model's tokenizer)")
        if not Path(calibration).is_file():
            raise ExportError("calibration", "the calibration file does not exist", value=str(calibration),
                              fix="pass a plain-text file")
        if _tokenizer_file(source) is None:
            raise ExportError("calibration", "int8-static tokenises the calibration text with the model's "
                              "tokenizer, and the source has no tokenizer.json", value=str(source),
                              fix="export from a checkpoint directory that holds tokenizer.json")
    elif calibration is not None:
        raise ExportError("calibration", "int8-dynamic takes no calibration (activations are quantised per call)",
                          value=str(calibration), fix="drop --calibration, or use --quantize int8-static")


def _tokenizer_file(source: str | os.PathLike[str] | None) -> Path | None:
    if source is None:
        return None
    path = Path(source) / "tokenizer.json"
    return path if path.is_file() else None


def calibration_batches(text_file: str | os.PathLike[str], tokenizer_file: str | os.PathLike[str], *,
                        windows: int = CALIBRATION_WINDOWS, tokens: int = CALIBRATION_TOKENS) -> list[np.ndarray]:
    """Token windows ``[1, tokens]`` (int64) of ``text_file``, tokenised with ``tokenizer_file``, evenly spread.

    Args:
        text_file: plain text.
        tokenizer_file: a Hugging Face ``tokenizer.json``.
        windows, tokens: how many windows and their length.

    Returns:
        up to ``windows`` arrays of shape ``[1, tokens]`` (fewer when the text is short).
    """
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    ids = tok.encode(Path(text_file).read_text(encoding="utf-8"), add_special_tokens=False).ids
    if len(ids) < 2:
        raise ExportError("calibration", f"the calibration text has {len(ids)} tokens", value=str(text_file),
                          fix="pass a text of at least a few hundred tokens")
    tokens = min(tokens, len(ids))
    starts = np.linspace(0, len(ids) - tokens, num=min(windows, max(1, len(ids) // tokens)), dtype=np.int64)
    return [np.asarray(ids[s:s + tokens], dtype=np.int64)[None, :] for s in sorted(set(starts.tolist()))]


def _activation_products(graph: Path) -> list[str]:
    """Names of the MatMul/Gemm nodes with no initializer input (attention's q·kᵀ and softmax·v)."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    weights = {i.name for i in proto.graph.initializer}
    weights |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in proto.graph.node if n.op_type in _OPS and not any(i in weights for i in n.input)]


def _outlier_inputs(graph: Path) -> list[str]:
    """int8-static keeps these projections float: each MLP's ``down_proj`` (its input is the SwiGLU product)
    and the LM head (its input is the final hidden state, and its output the logits greedy decoding ranks).

    Static quantisation gives each activation one range for every call, and these two inputs carry the
    outlier activations of the first positions, which stretch the range and leave ordinary tokens a few
    int8 steps. In bench/onnx_cpu.py this took greedy agreement with the float model from 0.14 to 0.88.
    ``down_proj`` is found by the name scope torch.onnx records on each node; the head by feeding ``logits``.
    """
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    consumers: dict[str, list[Any]] = {}
    for node in proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    names = []
    for node in proto.graph.node:
        if node.op_type not in _OPS:
            continue
        scopes = " ".join(p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes")
        if ".mlp.down_proj" in scopes or _feeds_logits(node, consumers):
            names.append(node.name)
    return names


def _feeds_logits(node: Any, consumers: dict[str, list[Any]]) -> bool:
    """Whether ``node``'s output reaches the ``logits`` output through shape-only ops and casts."""
    frontier = list(node.output)
    for _ in range(4):
        if "logits" in frontier:
            return True
        frontier = [o for name in frontier for n in consumers.get(name, ())
                    if n.op_type in ("Cast", "Identity", "Reshape") for o in n.output]
    return "logits" in frontier


def feeds_for(session: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's inputs for a prefill of ``ids [B, T]``: the KV graph gets a full mask, positions and an empty past."""
    B, T = ids.shape
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((B, T), dtype=np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T)).copy()
        elif inp.name.startswith("past_key_values."):
            kv, dh = inp.shape[1], inp.shape[3]
            dtype = np.float16 if "float16" in inp.type else np.float32
            feeds[inp.name] = np.zeros((B, kv, 0, dh), dtype=dtype)  # (B, KV, 0, Dh): no past
        else:
            raise ExportError("quantize", f"the graph has an input {inp.name!r} that calibration cannot fill",
                              fix="quantise a plyx export graph (model.onnx)")
    return feeds


class _Reader:
    """An ``onnxruntime.quantization.CalibrationDataReader`` over prefill feeds (built lazily as one)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._iter: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)


def quantize_graph(graph: Path, out: Path, mode: str, *, calibration: str | os.PathLike[str] | None = None,
                   tokenizer_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Write the int8 version of ``graph`` to ``out``; returns the settings to record.

    Args:
        graph: the float ONNX graph.
        out: where the int8 graph goes (``graph`` itself is left as it is).
        mode: ``int8-dynamic`` or ``int8-static``.
        calibration, tokenizer_file: the text and the tokenizer (``int8-static`` only).
    """
    ort = require("onnxruntime")
    quant = require("onnxruntime.quantization")
    common = {"per_channel": True, "weight_type": quant.QuantType.QInt8, "op_types_to_quantize": _OPS,
              "nodes_to_exclude": _activation_products(graph)}
    try:
        if mode == "int8-dynamic":
            quant.quantize_dynamic(str(graph), str(out), **common)
            return {"quantize": mode, "weights": "int8 per-channel", "activations": "dynamic (per call)",
                    "ops": _OPS, "tool": "onnxruntime.quantization.quantize_dynamic"}
        batches = calibration_batches(calibration, tokenizer_file)  # type: ignore[arg-type]
        kept_float = _outlier_inputs(graph)
        common["nodes_to_exclude"] = common["nodes_to_exclude"] + kept_float
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        reader = type("CalibrationReader", (_Reader, quant.CalibrationDataReader), {})([feeds_for(session, b)
                                                                                         for b in batches])
        # QOperator (QLinearMatMul) rather than QDQ: onnxruntime's CPU provider leaves a QDQ MatMul whose
        # output is not re-quantised as DequantizeLinear + float MatMul, which decoded at a fifth of the float
        # graph's speed in bench/onnx_cpu.py; uint8 activations with int8 weights are its x86 kernels' layout
        quant.quantize_static(str(graph), str(out), reader, quant_format=quant.QuantFormat.QOperator,
                              activation_type=quant.QuantType.QUInt8, calibrate_method=quant.CalibrationMethod.MinMax,
                              **common)
    except ExportError:
        raise
    except Exception as exc:  # onnxruntime.quantization raises many types
        raise ExportError("quantize", f"onnxruntime.quantization failed ({mode}): {type(exc).__name__}: {exc}",
                          value=mode, fix="export without --quantize, or report the graph to plyx") from exc
    return {"quantize": mode, "weights": "int8 per-channel", "activations": "uint8 static (QOperator, MinMax)",
            "ops": _OPS, "kept_float": kept_float, "calibration": {"file": str(Path(str(calibration)).resolve()), "windows": len(batches),
                                         "tokens_per_window": int(batches[0].shape[1])},
            "tool": "onnxruntime.quantization.quantize_static"}


def measure_quantized(graph: Path, model: Any, *, greedy_tokens: int = 0, seed: int = 0) -> dict[str, Any]:
    """How far the int8 ``graph`` is from the float torch ``model``: logits, top-1 and greedy agreement.

    Args:
        graph: the int8 graph (prefill or KV-cache).
        model: the float ``TransformerLM`` it came from.
        greedy_tokens: > 0 (KV graphs): also decode this many tokens greedily on both sides.
        seed: seed of the token ids.

    Returns:
        ``{"max_abs_error", "max_rel_error", "top1_agreement", "greedy": {...} | None}``; raises
        ``ExportVerificationError`` when the graph's logits are not finite.
    """
    import torch
    from plyx.export._errors import ExportVerificationError
    from plyx.export._kernels import reference_kernels
    from plyx.export._verify_kv import KVSession, greedy_torch

    ort = require("onnxruntime")
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    T = min(32, config.max_seq_len)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=generator)  # (2, T)
    with torch.no_grad(), reference_kernels():
        want = model(ids).float()  # (2, T, V)
    got = torch.from_numpy(session.run(["logits"], feeds_for(session, ids.numpy()))[0]).float()
    if not bool(torch.isfinite(got).all()):
        raise ExportVerificationError(f"the int8 graph {graph.name} returns non-finite logits", report=None,
                                      fix="the export was not kept; try int8-dynamic, or export float32")
    max_abs = float((got - want).abs().max())
    scale = float(want.abs().max())
    quality: dict[str, Any] = {
        "logits_shape": [2, T],
        "max_abs_error": max_abs,
        "max_rel_error": max_abs / scale if scale else 0.0,
        "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "greedy": None,
    }
    prompt_len = min(5, config.max_seq_len - 1)
    steps = min(greedy_tokens, config.max_seq_len - prompt_len)
    if steps > 0:
        prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=generator).tolist()
        want_ids, _ = greedy_torch(model, prompt, steps)
        got_ids = KVSession(graph).greedy(prompt, steps)
        first = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b), steps)
        quality["greedy"] = {"tokens": steps, "equal_prefix": first, "agreement": first / steps}
    return quality
