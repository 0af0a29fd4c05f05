"""Run an exported graph in onnxruntime and compare its logits with the torch model's.

For each ``[B, T]`` shape, fresh random token ids go through both; the graph
passes when ``max |onnx - torch| <= atol + rtol * max |torch|`` and every logit
is finite. The tolerance is relative to the logits' scale (not per element),
so logits near zero do not fail on rounding noise. The torch side runs with
the reference kernels, the same math the graph was traced from.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from plyx.export._deps import require, version_of
from plyx.export._errors import ExportError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._result import ShapeCheck, VerificationReport

__all__ = ["DEFAULT_TOLERANCES", "default_shapes", "verify_onnx"]

#: dtype -> (atol, rtol): float32 differs only by summation order; float16 rounds every op to 11 bits
DEFAULT_TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2)}
_PROVIDER = "CPUExecutionProvider"


def default_shapes(max_seq_len: int, seq_len: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
    """Two ``[B, T]`` shapes that differ from each other and from the traced example ``[2, 7]``."""
    if seq_len is not None:
        return (1, seq_len), (3, seq_len)
    return (1, min(5, max_seq_len)), (3, min(11, max_seq_len))


def verify_onnx(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int | None = None,
    raise_on_failure: bool = True,
) -> VerificationReport:
    """Compare the graph at ``path`` with ``model`` on random token ids of each shape.

    Args:
        path: the ``model.onnx`` file (external data next to it is found by onnxruntime).
        model: the ``TransformerLM`` it was exported from.
        shapes: ``[B, T]`` shapes to check; default: two (``default_shapes``).
        atol, rtol: tolerance; default from ``DEFAULT_TOLERANCES`` by the model's dtype.
        seed: seed of the token ids; default: a fresh random one (recorded in the report).
        raise_on_failure: raise ``ExportVerificationError`` when a shape fails.

    Returns:
        a ``VerificationReport`` with max abs and rel errors per shape.

    Example::

        report = verify_onnx("exports/tiny/model.onnx", model)
        print(report.summary())
    """
    ort = require("onnxruntime")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ExportError("model", f"expected a plyx.model.TransformerLM (with a ModelConfig), got {type(model).__name__}",
                          fix="pass the model the graph was exported from")
    weight = next(model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float16"])
    atol = default_atol if atol is None else float(atol)
    rtol = default_rtol if rtol is None else float(rtol)
    if not (atol >= 0 and rtol >= 0):
        raise ExportError("atol/rtol", f"tolerances must be >= 0, got atol={atol}, rtol={rtol}",
                          fix=f"use the defaults for {dtype} ({default_atol:g}, {default_rtol:g})")
    shapes = tuple(shapes) if shapes is not None else default_shapes(config.max_seq_len)
    seed = secrets.randbits(31) if seed is None else int(seed)
    try:
        session = ort.InferenceSession(str(path), providers=[_PROVIDER])
    except Exception as exc:  # onnxruntime raises its own error types
        raise ExportError("verify", f"onnxruntime cannot load {str(path)!r}: {type(exc).__name__}: {exc}",
                          fix="the graph uses an op or opset this onnxruntime lacks: upgrade onnxruntime "
                              "or export with a lower opset") from exc
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    checks = []
    try:
        for batch, seq_len in shapes:
            ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)  # (B, T) int64
            with torch.no_grad(), reference_kernels():
                expected = model(ids.to(weight.device)).float().cpu()  # (B, T, V)
            got = torch.from_numpy(session.run(["logits"], {"input_ids": ids.numpy()})[0]).float()
            checks.append(_compare(batch, seq_len, got, expected, atol, rtol))
    finally:
        model.train(was_training)
    report = VerificationReport(runtime=f"onnxruntime {version_of('onnxruntime')} ({_PROVIDER})", dtype=dtype,
                                atol=atol, rtol=rtol, seed=seed, checks=checks)
    if raise_on_failure and not report.ok:
        bad = next(c for c in report.checks if not c.passed)
        raise ExportVerificationError(
            f"the ONNX graph {Path(path).name} disagrees with the torch model at input_ids [{bad.batch}, "
            f"{bad.seq_len}]: max abs error {bad.max_abs_error:.3g} > tolerance {bad.tolerance:.3g} "
            f"(atol {atol:g} + rtol {rtol:g} * max|logits| {bad.max_abs_logit:.3g}), max rel error "
            f"{bad.max_rel_error:.3g}, token ids seed {seed}",
            report=report,
            fix="the export was not kept; check that every kernel the model uses has a pure-torch `reference` "
                "implementation, or, if the difference is rounding in a large model, raise atol/rtol (--atol/--rtol)",
        )
    return report


def _compare(batch: int, seq_len: int, got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> ShapeCheck:
    if tuple(got.shape) != tuple(expected.shape):
        raise ExportError("verify", f"the ONNX graph returned logits of shape {list(got.shape)} for input_ids "
                          f"[{batch}, {seq_len}], the torch model {list(expected.shape)}",
                          fix="export again; the graph's dynamic axes do not match the model")
    diff = (got.double() - expected.double()).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    tolerance = atol + rtol * scale
    finite = bool(torch.isfinite(got).all()) and bool(torch.isfinite(expected).all())
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return ShapeCheck(batch, seq_len, max_abs, rel, scale, tolerance, passed=finite and max_abs <= tolerance)


def run_onnx(path: str | os.PathLike[str], input_ids: Any) -> Any:
    """Logits ``[B, T, V]`` (numpy float32) of the graph at ``path`` for ``input_ids [B, T]`` (int64)."""
    ort = require("onnxruntime")
    session = ort.InferenceSession(str(path), providers=[_PROVIDER])
    return session.run(["logits"], {"input_ids": input_ids})[0]
