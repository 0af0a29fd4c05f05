"""``--format hf``: a Hugging Face directory that ``transformers`` loads with equal logits.

plyx-model's ``save_hf`` writes ``config.json`` and the safetensors weights; this
exporter adds what a Hugging Face consumer also reads:

- the special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) in
  ``config.json`` and in ``generation_config.json``: without them transformers falls back
  to the architecture's defaults (Llama: bos 1, eos 2), which are other tokens of a plyx
  tokenizer, so ``generate`` would stop on the wrong id;
- the tokenizer files of the source checkpoint, and a ``tokenizer_config.json`` /
  ``special_tokens_map.json`` naming those tokens when the checkpoint has none, so
  ``AutoTokenizer.from_pretrained`` loads it;
- ``plyx_export.json`` (the plyx config, source card and verification figures).

Verification loads the directory with ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` and compares logits (two shapes) and tokenisation with plyx's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from plyx.export._deps import require, version_of
from plyx.export._errors import ExportError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._onnx import MANIFEST_FILE, _check_source, _copy_tokenizer, _manifest
from plyx.export._result import ExportResult, VerificationReport
from plyx.export._special import SpecialTokens, special_tokens
from plyx.export._verify import DEFAULT_TOLERANCES, _compare, default_shapes
from torch import nn

__all__ = ["check_hf", "verify_hf", "write_hf"]

GENERATION_CONFIG = "generation_config.json"
_SAMPLE_TEXT = "To be, or not to be, that is the question: 0123 <tags> & émigré"


def check_hf(config: Any) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``config``; ``ExportError`` before any work when there is none."""
    from plyx.model import config_to_hf

    try:
        return config_to_hf(config)
    except ValueError as exc:
        raise ExportError("format", f"format 'hf' cannot express this {config.arch} model: {exc}", value="hf",
                          fix="use --format onnx or gguf, or a supported architecture (llama without q/k/v "
                              "biases, qwen2, qwen3, mistral)") from exc


def write_hf(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    source: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Write ``model`` as a Hugging Face directory into ``out_dir`` (the ``hf`` exporter's factory).

    Args:
        model: a ``plyx.model.TransformerLM``.
        out_dir: the (temporary) export directory.
        verify: load it with transformers and compare logits and tokenisation (needs ``transformers``).
        atol, rtol: logit tolerance (defaults by dtype, as for ONNX).
        source: the checkpoint directory (tokenizer files and card).

    Returns:
        an ``ExportResult`` (``.model`` is ``model.safetensors`` or the shard index).
    """
    from plyx.model import TransformerLM, save_hf

    if not isinstance(model, TransformerLM):
        raise ExportError("model", f"expected a plyx.model.TransformerLM, got {type(model).__name__}",
                          fix="load one with plyx.model.load_checkpoint(path)")
    hf_config = check_hf(model.config)
    if verify:
        require("transformers", extra="hf")
    source_dir = _check_source(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staged = out / ".save_hf"
    save_hf(model, staged)
    for path in sorted(staged.iterdir()):
        os.replace(path, out / path.name)
    shutil.rmtree(staged, ignore_errors=True)

    tokenizer = _copy_tokenizer(source_dir, out)
    special = special_tokens(out / "tokenizer.json")
    hf_config.update(special.ids())
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    generation = {"_from_model_config": False, **special.ids(), "max_length": model.config.max_seq_len}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    tokenizer += _tokenizer_configs(out, special, model.config.max_seq_len)

    report = verify_hf(out, model, atol=atol, rtol=rtol) if verify else None
    weights = out / "model.safetensors"
    index = out / "model.safetensors.index.json"
    settings = {"format": "hf", "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "special_tokens": _special_summary(special), "files": "config.json, generation_config.json, "
                "model.safetensors (or shards + index), tokenizer files"}
    manifest = out / MANIFEST_FILE
    manifest.write_text(json.dumps(_manifest(model.config, settings, source_dir, report, exporter="plyx.model.save_hf",
                                             packages=("transformers",)),
                                   indent=2) + "\n", encoding="utf-8")
    files = sorted(p for p in out.iterdir() if p.is_file())
    return ExportResult(format="hf", path=out, files=files, model=weights if weights.exists() else index,
                        config=out / "config.json", manifest=manifest, tokenizer=tuple(sorted(set(tokenizer))),
                        verification=report, settings=settings)


def _special_summary(special: SpecialTokens) -> dict[str, Any]:
    return {"bos": special.bos, "eos": special.eos, "pad": special.pad, **special.ids()}


def _tokenizer_configs(out: Path, special: SpecialTokens, max_len: int) -> list[Path]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` when the checkpoint brought none."""
    if not (out / "tokenizer.json").is_file():
        return []
    tokens = {k: v for k, v in (("bos_token", special.bos), ("eos_token", special.eos), ("pad_token", special.pad))
              if v is not None}
    written = []
    config = out / "tokenizer_config.json"
    if not config.exists():
        body = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **tokens}
        config.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        written.append(config)
    mapping = out / "special_tokens_map.json"
    if not mapping.exists():
        mapping.write_text(json.dumps(tokens, indent=2) + "\n", encoding="utf-8")
        written.append(mapping)
    return written


def verify_hf(path: str | os.PathLike[str], model: nn.Module, *, atol: float | None = None, rtol: float | None = None,
              seed: int | None = None) -> VerificationReport:
    """Load ``path`` with transformers and compare logits at two ``[B, T]`` shapes, the special token ids
    of config and generation config, and (with a tokenizer) the token ids of a sample text.

    Raises:
        ExportVerificationError: naming the check that failed and the measured difference.
    """
    transformers = require("transformers", extra="hf")
    config = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float16"])
    atol = default_atol if atol is None else float(atol)
    rtol = default_rtol if rtol is None else float(rtol)
    seed = secrets.randbits(31) if seed is None else int(seed)
    path = Path(path)
    fix = "the export was not kept; report the model config to plyx (save_hf and transformers disagree)"
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=next(model.parameters()).dtype).eval()
    except Exception as exc:  # transformers raises many types
        raise ExportVerificationError(f"transformers cannot load the export: {type(exc).__name__}: {exc}",
                                      report=None, fix=fix) from exc
    expected = special_tokens(path / "tokenizer.json").ids()
    for name, want in expected.items():
        got_config, got_generation = getattr(hf.config, name, None), getattr(hf.generation_config, name, None)
        if got_config != want or got_generation != want:
            raise ExportVerificationError(f"transformers reads {name} {got_config} (config) / {got_generation} "
                                          f"(generation config), the tokenizer's is {want}", report=None, fix=fix)
    generator = torch.Generator().manual_seed(seed)
    checks = []
    for batch, seq_len in default_shapes(config.max_seq_len):
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)  # (B, T)
        with torch.no_grad(), reference_kernels():
            want = model(ids).float()  # (B, T, V)
            got = hf(ids).logits.float()
        checks.append(_compare(batch, seq_len, got, want, atol, rtol))
    report = VerificationReport(runtime=f"transformers {version_of('transformers')} (AutoModelForCausalLM)",
                                dtype=dtype, atol=atol, rtol=rtol, seed=seed, checks=checks, graph="hf")
    bad = next((c for c in checks if not c.passed), None)
    if bad is not None:
        raise ExportVerificationError(
            f"transformers' logits differ from plyx's at input_ids [{bad.batch}, {bad.seq_len}]: max abs error "
            f"{bad.max_abs_error:.3g} > tolerance {bad.tolerance:.3g}, seed {seed}", report=report, fix=fix)
    if (path / "tokenizer.json").is_file():
        _check_tokenizer(transformers, path)
    return report


def _check_tokenizer(transformers: Any, path: Path) -> None:
    tokenizers = require("tokenizers", extra="hf")
    ours = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode(_SAMPLE_TEXT, add_special_tokens=False).ids
    try:
        theirs = transformers.AutoTokenizer.from_pretrained(str(path))(_SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception as exc:  # transformers raises many types
        raise ExportVerificationError(f"transformers cannot load the tokenizer: {type(exc).__name__}: {exc}",
                                      report=None, fix="the export was not kept; check the checkpoint's "
                                                       "tokenizer files") from exc
    if list(theirs) != list(ours):
        first = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise ExportVerificationError(f"AutoTokenizer encodes the sample text differently from tokenizer.json from "
                                      f"token {first} ({len(theirs)} vs {len(ours)} tokens)", report=None,
                                      fix="the export was not kept; check tokenizer_config.json of the checkpoint")
