"""``export`` and ``export_onnx``: write atomically, then fire ``plyx_on_export_written``.

Every format goes the same way: the exporter's factory writes into an empty
temporary directory beside the destination, the directory is renamed into
place only when the factory returned (for ONNX: after onnxruntime agreed with
torch), and then every plugin's ``plyx_on_export_written`` runs on the final
directory (plyx-governance writes the SBOM, checksums, signature and card there).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from plyx.export._atomic import atomic_directory
from plyx.export._errors import ExportError, ExportHookError
from plyx.export._onnx import DEFAULT_OPSET, write_onnx
from plyx.export._result import ExportResult
from plyx.export._verify_kv import DEFAULT_GREEDY_TOKENS
from plyx.specs import Component, plugins

__all__ = ["available_formats", "export", "export_onnx", "exporter"]

HOOK = "plyx_exporters"


def available_formats() -> dict[str, Component]:
    """Every exporter contributed through the ``plyx_exporters`` hook, by format name."""
    return plugins.components(HOOK)


def exporter(format: str) -> Component:
    """The exporter ``Component`` for ``format``; ``ExportError`` naming the installed ones otherwise."""
    found = available_formats()
    if format not in found:
        have = ", ".join(sorted(found)) or "none (no plugin implements plyx_exporters)"
        raise ExportError("format", f"export format {format!r} not found. It is either misspelled or not installed "
                          f"(available formats: {have})", fix="pick one of the available formats, or install the "
                          "distribution that provides it (`plyx plugins` lists what is installed)")
    return found[format]


def export(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    format: str = "onnx",
    source: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
    hooks: bool = True,
    **options: Any,
) -> ExportResult:
    """Export ``model`` in ``format``, found by name among the ``plyx_exporters`` components.

    Args:
        model: the model (a ``plyx.model.TransformerLM`` for the built-in ``onnx``).
        out_dir: the export directory; written atomically.
        format: an exporter name (``available_formats()``).
        source: the checkpoint directory the model came from (tokenizer and card are
            carried over; the hook records it as the export's input).
        name: release name given to the hook (default: the source card's name, else the directory name).
        force: replace ``out_dir`` when it exists and is not empty.
        hooks: fire ``plyx_on_export_written`` after writing.
        options: passed to the exporter's factory (for onnx: ``export_onnx``'s keywords).

    Example::

        result = export(model, "exports/tiny", format="onnx", source="runs/step-100")
    """
    component = exporter(format)
    return _export(component.factory, format, model, out_dir, source=source, name=name, force=force,
                   hooks=hooks, options=options)


def export_onnx(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    seq_len: int | None = None,
    opset: int = DEFAULT_OPSET,
    dtype: str | torch.dtype = "float32",
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    source: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
    hooks: bool = True,
    with_kv_cache: bool = False,
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
    quantize: str | None = None,
    calibration: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Export a ``TransformerLM`` to ONNX, verify it in onnxruntime, fire the hook.

    Args:
        model: the model; it is not modified (a copy is made when ``dtype`` differs).
        out_dir: the export directory (``model.onnx``, ``config.json``, ``plyx_export.json``,
            tokenizer files); written in a temporary sibling and renamed when verified.
        seq_len: fix the sequence axis to this length; None keeps batch and sequence dynamic.
        opset: ONNX opset, 18 or newer.
        dtype: weight dtype of the graph: ``float32`` or ``float16`` (logits are float32 either way).
        verify: run the graph in onnxruntime on two random ``[B, T]`` shapes and compare the
            logits with torch; a difference above tolerance raises ``ExportVerificationError``
            and nothing is written.
        atol, rtol: verification tolerance (``max|diff| <= atol + rtol * max|logits|``);
            default 1e-4, 1e-4 for float32 and 2e-2, 2e-2 for float16.
        source: the checkpoint directory the model was loaded from (card and tokenizer are carried over).
        name: release name given to the hook.
        force: replace ``out_dir`` when it exists and is not empty.
        hooks: fire ``plyx_on_export_written`` after writing.
        with_kv_cache: export the decoding graph (``past_key_values.N.key/value`` in,
            ``present.N.key/value`` out, ``attention_mask``, ``position_ids``; Optimum's names)
            instead of the prefill graph. Verification then checks logits through prefill and
            cached decode steps, and a greedy decode of ``greedy_tokens`` equal to plyx's.
        greedy_tokens: length of that greedy comparison (default 64; capped by ``max_seq_len``).
        quantize: ``int8-dynamic`` or ``int8-static`` (``onnxruntime.quantization``, per-channel
            int8 weights): ``model.onnx`` is then the int8 graph, made from the verified float one,
            and its distance from the float model is recorded (``settings["quantization"]``).
        calibration: text file for ``int8-static``, tokenised with the source checkpoint's tokenizer.

    Returns:
        an ``ExportResult`` (``.model`` is the ``model.onnx`` path, ``.verification`` the figures).

    Example::

        from plyx.model import load_checkpoint
        from plyx.export import export_onnx

        model = load_checkpoint("runs/step-100")
        result = export_onnx(model, "exports/tiny", source="runs/step-100")
        print(result.verification.summary())
    """
    options = {"seq_len": seq_len, "opset": opset, "dtype": dtype, "verify": verify, "atol": atol, "rtol": rtol,
               "with_kv_cache": with_kv_cache, "greedy_tokens": greedy_tokens, "quantize": quantize,
               "calibration": calibration}
    return _export(write_onnx, "onnx", model, out_dir, source=source, name=name, force=force, hooks=hooks,
                   options=options)


def _export(
    factory: Callable[..., Any],
    format: str,
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None,
    name: str | None,
    force: bool,
    hooks: bool,
    options: dict[str, Any],
) -> ExportResult:
    dest = Path(out_dir).absolute()
    if source is not None and not Path(source).is_dir():
        raise ExportError("source", f"checkpoint directory {str(source)!r} does not exist",
                          fix="pass the directory the model was loaded from, or leave source unset")
    kwargs = dict(options)
    if source is not None:
        kwargs["source"] = source
    with atomic_directory(dest, force=force) as tmp:
        produced = factory(model, tmp, **kwargs)
        result = _as_result(produced, format, tmp)
    result = result.relocated(tmp, dest)
    if hooks:
        fire_export_written(result, model, source=source, name=name)
    return result


def _as_result(produced: Any, format: str, tmp: Path) -> ExportResult:
    """A third-party factory may return any iterable of paths; ours returns an ``ExportResult``."""
    if isinstance(produced, ExportResult):
        return produced
    if produced is None:
        files: Iterable[Any] = sorted(p for p in tmp.rglob("*") if p.is_file())
    elif isinstance(produced, (str, os.PathLike)):
        files = [produced]
    else:
        files = list(produced)
    paths = [Path(p) if Path(p).is_absolute() else tmp / p for p in files]
    return ExportResult(format=format, path=tmp, files=paths)


def _source_name(source: str | os.PathLike[str] | None) -> str | None:
    if source is None:
        return None
    from plyx.model import CheckpointError, open_checkpoint

    try:
        return open_checkpoint(source).card.name
    except CheckpointError:
        return None


def export_metadata(result: ExportResult, model: torch.nn.Module, *, source: str | os.PathLike[str] | None = None,
                    name: str | None = None) -> dict[str, Any]:
    """The ``metadata`` of ``plyx_on_export_written`` for ``result`` (keys of plyx.specs.hookspecs).

    ``artifacts`` (absolute paths of every exported file), ``source`` (the checkpoint
    directory, when known), ``config`` (``{"model": ModelConfig dict, "export": settings}``),
    ``name``, plus ``format`` and ``verification`` (the onnxruntime figures, when run).
    """
    config = getattr(model, "config", None)
    metadata: dict[str, Any] = {
        "artifacts": [str(p) for p in result.files],
        "config": {"model": config.to_dict() if hasattr(config, "to_dict") else {},
                   "export": dict(result.settings)},
        "name": name or _source_name(source) or result.path.name,
        "format": result.format,
    }
    if source is not None:
        metadata["source"] = str(Path(source).absolute())
    if result.verification is not None:
        metadata["verification"] = result.verification.to_dict()
    return metadata


def fire_export_written(result: ExportResult, model: torch.nn.Module, *, source: str | os.PathLike[str] | None = None,
                        name: str | None = None) -> None:
    """Call every plugin's ``plyx_on_export_written`` for a written export."""
    metadata = export_metadata(result, model, source=source, name=name)
    hook = plugins.get_plugin_manager().hook
    try:
        hook.plyx_on_export_written(path=str(result.path), format=result.format, metadata=metadata)
    except Exception as exc:  # a plugin may fail in any way; the export itself is complete
        raise ExportHookError(
            f"the export was written to {str(result.path)!r}, but a plugin's hook raised "
            f"{type(exc).__name__}: {exc}", result=result,
            fix="fix the cause named above and re-run the export with --force (force=True); "
                "`plyx plugins` lists the plugins that implement the hook",
        ) from exc
