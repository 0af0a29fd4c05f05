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
    onnx.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                      help="compare onnxruntime with torch on two random [B, T] shapes (default: on)")
    onnx.add_argument("--atol", type=float, help="absolute tolerance of --verify (default: 1e-4 for float32)")
    onnx.add_argument("--rtol", type=float, help="tolerance relative to max|logits| (default: 1e-4 for float32)")
    onnx.add_argument("--with-kv-cache", action="store_true", default=None,
                      help="export the decoding graph: past_key_values.N.key/value in, present.N.key/value out, "
                           "attention_mask, position_ids (Optimum / onnxruntime-genai names)")
    onnx.add_argument("--greedy-tokens", type=int,
                      help="tokens of the greedy decode compared with plyx's (--with-kv-cache; default 64)")
    onnx.add_argument("--quantize", choices=["int8-dynamic", "int8-static"],
                      help="int8 graph through onnxruntime.quantization (per-channel weights)")
    onnx.add_argument("--calibration", help="text file for int8-static, tokenised with the checkpoint's tokenizer")
    parser.add_argument("--no-hooks", dest="hooks", action="store_false",
                        help="do not fire plyx_on_export_written (no governance records)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _options(args: argparse.Namespace) -> dict[str, object]:
    """Format options: only those given, so a third-party exporter is not handed flags it does not take."""
    options: dict[str, object] = {k: getattr(args, k) for k in ("seq_len", "opset", "dtype", "atol", "rtol", "with_kv_cache",
                                                           "greedy_tokens", "quantize", "calibration")
                                  if getattr(args, k) is not None}
    if not args.verify:
        options["verify"] = False
    return options


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
        model = load_checkpoint(ckpt, dtype=args.dtype or "float32")
        result = _export(component.factory, args.format, model, args.out, source=ckpt, name=args.name,
                         force=args.force, hooks=args.hooks, options=_options(args))
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
