"""``plyx export CHECKPOINT --format onnx --out DIR``: load, export, verify, fire the hook."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plyx.specs import CliCommand

__all__ = ["command"]

HELP = "export a checkpoint (ONNX built in; more formats through plugins), verified and atomically written"


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a plyx checkpoint or Hugging Face model directory")
    parser.add_argument("--format", default="onnx", help="exporter name (default: onnx); unknown names list the installed ones")
    parser.add_argument("--out", required=True, help="export directory (written in a temporary sibling, then renamed)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists and is not empty")
    parser.add_argument("--name", help="release name given to plyx_on_export_written (default: the card's name)")
    onnx = parser.add_argument_group("onnx")
    onnx.add_argument("--seq-len", type=int, help="fix the sequence axis (default: dynamic batch and sequence)")
    onnx.add_argument("--opset", type=int, help="ONNX opset (default: 18)")
    onnx.add_argument("--dtype", choices=["float32", "float16"], help="weight dtype of the graph (default: float32)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="check the export with its consumer (onnxruntime, transformers, gguf + transformers) "
                             "against plyx on random [B, T] shapes (default: on)")
    parser.add_argument("--atol", type=float, help="absolute tolerance of --verify (default: 1e-4 for float32; "
                                                   "gguf: the outtype's quantisation tolerance)")
    parser.add_argument("--rtol", type=float, help="tolerance relative to max|logits| (default: as --atol)")
    onnx.add_argument("--with-kv-cache", action="store_true", default=None,
                      help="export the decoding graph: past_key_values.N.key/value in, present.N.key/value out, "
                           "attention_mask, position_ids (Optimum / onnxruntime-genai names)")
    onnx.add_argument("--greedy-tokens", type=int,
                      help="tokens of the greedy decode compared with plyx's (--with-kv-cache; default 64)")
    onnx.add_argument("--quantize", choices=["int8-dynamic", "int8-static"],
                      help="int8 graph through onnxruntime.quantization (per-channel weights)")
    onnx.add_argument("--calibration", help="text file for int8-static, tokenised with the checkpoint's tokenizer")
    gguf = parser.add_argument_group("gguf")
    gguf.add_argument("--outtype", choices=["f16", "q8_0"], help="GGUF matrix type (default: f16)")
    parser.add_argument("--no-hooks", dest="hooks", action="store_false",
                        help="do not fire plyx_on_export_written (no governance records)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _options(args: argparse.Namespace) -> dict[str, object]:
    """Format options: only those given, so a third-party exporter is not handed flags it does not take."""
    options: dict[str, object] = {k: getattr(args, k) for k in ("seq_len", "opset", "dtype", "atol", "rtol", "with_kv_cache",
                                                           "greedy_tokens", "quantize", "calibration", "outtype")
                                  if getattr(args, k) is not None}
    if not args.verify:
        options["verify"] = False
    return options


def _check_options(factory: object, format: str, options: dict[str, object]) -> None:
    """Refuse flags the format's exporter does not take, naming them (before anything is loaded)."""
    import inspect

    from plyx.export._errors import ExportError

    params = inspect.signature(factory).parameters  # type: ignore[arg-type]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(k for k in options if k not in params)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise ExportError("format", f"format {format!r} does not take {flags}", value=format,
                          fix=f"drop {flags}, or pick a format that takes it (`plyx export --help` groups the flags)")


def _precheck(format: str, ckpt: Path, options: dict[str, object]) -> None:
    """A built-in format's architecture checks on the checkpoint's config, before its weights are loaded."""
    from plyx.model import open_checkpoint

    if format not in ("hf", "gguf"):
        return
    config = open_checkpoint(ckpt).config
    if format == "hf":
        from plyx.export._hf import check_hf

        check_hf(config)
    else:
        from plyx.export._gguf import check_gguf

        check_gguf(config, str(options.get("outtype", "f16")))


def _run(args: argparse.Namespace) -> int:
    from plyx.export._api import _export, exporter
    from plyx.export._atomic import check_destination
    from plyx.export._errors import ExportError
    from plyx.model import CheckpointError, load_checkpoint

    try:
        component = exporter(args.format)  # cheap checks first: nothing is loaded for a typo
        check_destination(Path(args.out), force=args.force)
        ckpt = Path(args.checkpoint)
        if not ckpt.exists():
            raise ExportError("checkpoint", f"{str(ckpt)!r} does not exist",
                              fix="pass the directory save_checkpoint() or save_pretrained() wrote")
        # loaded straight into the export dtype: no second copy of the weights for the conversion
        options = _options(args)
        _check_options(component.factory, args.format, options)
        _precheck(args.format, ckpt, options)
        model = load_checkpoint(ckpt, dtype=args.dtype or "float32")
        result = _export(component.factory, args.format, model, args.out, source=ckpt, name=args.name,
                         force=args.force, hooks=args.hooks, options=options)
    except (ExportError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"format": result.format, "path": str(result.path), "files": [str(p) for p in result.files],
                          "verification": result.verification.to_dict() if result.verification else None}, indent=2))
        return 0
    print(f"exported {args.checkpoint} as {result.format} to {result.path}")
    for path in result.files:
        print(f"  {path.relative_to(result.path)}  {path.stat().st_size:,} bytes")
    if result.verification is not None:
        print(result.verification.summary())
    return 0


def command() -> CliCommand:
    return CliCommand("export", HELP, _configure, _run)
