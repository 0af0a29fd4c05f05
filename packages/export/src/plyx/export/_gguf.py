"""``--format gguf``: one llama.cpp GGUF file written with the ``gguf`` package (llama.cpp's own writer).

What goes in, as llama.cpp's ``convert_hf_to_gguf.py`` writes it:

- the architecture (``llama`` for plyx llama and mistral, ``qwen2``, ``qwen3``) and its
  hyper-parameters (context length, widths, heads, key/value length, RoPE base, norm eps);
- tensors under llama.cpp's names (``gguf.get_tensor_name_map``): matrices in ``f16`` or
  ``q8_0`` (blocks of 32 int8 with one f16 scale; a matrix whose rows are not a multiple of
  32 stays f16, as the converter does), norms and biases in f32. For ``llama``, q and k
  rows are permuted to llama.cpp's rotary layout (the converter's ``permute``);
- the tokenizer, when the source checkpoint has a byte-level BPE ``tokenizer.json``:
  tokens, merges, token types and the bos/eos/pad ids (``tokenizer.ggml.*``, model ``gpt2``).

Verification reads the file back with ``gguf.GGUFReader`` (every metadata key, tensor
name, shape and type, the tokens), loads it with transformers' GGUF loader
(``from_pretrained(dir, gguf_file=...)``) and compares its logits with plyx's model
holding the file's (dequantised) weights, at float32 tolerance: quantisation moves the
weights, not the maths, so both sides must agree exactly up to summation order. The
quantisation's own effect (file weights vs the original) is measured separately and gated
at a tolerance per type (see ``QUANT_TOLERANCES``).
"""

from __future__ import annotations

import copy
import json
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch
from plyx.export._deps import require, version_of
from plyx.export._errors import ExportError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._onnx import MANIFEST_FILE, _check_source, _manifest
from plyx.export._result import ExportResult, VerificationReport
from plyx.export._special import special_tokens
from plyx.export._verify import DEFAULT_TOLERANCES, _compare, default_shapes
from torch import nn

__all__ = ["GGUF_ARCHITECTURES", "OUTTYPES", "QUANT_TOLERANCES", "check_gguf", "verify_gguf", "write_gguf"]

#: plyx arch -> llama.cpp architecture (llama.cpp runs Mistral as llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
OUTTYPES = ("f16", "q8_0")
#: (atol, rtol) of the file's logits against the original float32 model, by outtype: a bound on the
#: quantisation loss that catches a broken file (wrong scales, garbage blocks), not the normal rounding.
#: f16 rounds each weight to 11 significant bits (relative error <= 2^-11), as a float16 ONNX export does,
#: so it gets the same 2e-2. q8_0 stores each block of 32 weights as int8 times max|block|/127: an error of
#: up to max|block|/254 per weight, about 8x f16's on Gaussian weights, so 0.15 (measured on the tests' tiny
#: random models, whose large weights amplify errors most: 0.065 of max|logits|).
#: The exactness check is separate: transformers' loader against plyx holding the file's dequantised weights
#: at float32 tolerance (int8 x f16 scale is exact in float32: 8 + 11 bits < 24).
QUANT_TOLERANCES = {"f16": (2e-2, 2e-2), "q8_0": (0.15, 0.15)}
_BLOCK = 32  # q8_0 block length (gguf.GGML_QUANT_SIZES)


def check_gguf(config: Any, outtype: str = "f16") -> str:
    """The llama.cpp architecture of ``config``; ``ExportError`` before any work for what GGUF cannot hold."""
    supported = ", ".join(f"{k} (as {v})" for k, v in GGUF_ARCHITECTURES.items())

    def refuse(problem: str, fix: str) -> ExportError:
        return ExportError("format", f"format 'gguf' cannot hold this {config.arch} model: {problem}", value="gguf",
                           fix=fix)

    if outtype not in OUTTYPES:
        raise ExportError("outtype", "unknown GGUF tensor type", value=outtype, fix=f"use one of {', '.join(OUTTYPES)}")
    arch = GGUF_ARCHITECTURES.get(config.arch)
    if arch is None:
        raise refuse(f"llama.cpp has no architecture for {config.arch!r}", f"supported: {supported}")
    if config.rope_scaling is not None:
        raise refuse(f"RoPE scaling ({config.rope_scaling.kind}) is not written", "export to onnx or hf; GGUF "
                     "supports unscaled RoPE")
    if config.partial_rotary != 1.0:
        raise refuse(f"partial rotary ({config.partial_rotary}) is not written", "export to onnx or hf")
    if config.sliding_window is not None and config.sliding_window < config.max_seq_len:
        raise refuse(f"llama.cpp's {arch} architecture has no sliding window (window {config.sliding_window} < "
                     f"max_seq_len {config.max_seq_len})", "export to onnx or hf, which keep the window")
    if config.qkv_bias and arch != "qwen2":
        raise refuse("q/k/v biases exist only in llama.cpp's qwen2 architecture", f"supported: {supported}")
    if config.qk_norm and arch != "qwen3":
        raise refuse("QK-norm exists only in llama.cpp's qwen3 architecture", f"supported: {supported}")
    if arch == "qwen2" and not config.qkv_bias:
        raise refuse("llama.cpp's qwen2 architecture needs q/k/v biases", "export as llama (arch='llama')")
    return arch


def write_gguf(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    outtype: str = "f16",
    verify: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    source: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Write ``model`` as ``model-<outtype>.gguf`` into ``out_dir`` (the ``gguf`` exporter's factory).

    Args:
        model: a ``plyx.model.TransformerLM``.
        out_dir: the (temporary) export directory.
        outtype: ``f16`` or ``q8_0`` (matrices; norms and biases stay f32).
        verify: read it back (gguf reader, transformers' GGUF loader) and compare (see module doc).
        atol, rtol: tolerance of the quantisation check against the original model (default ``QUANT_TOLERANCES``).
        source: the checkpoint directory (tokenizer and card).

    Returns:
        an ``ExportResult`` whose ``.model`` is the ``.gguf`` file.
    """
    from plyx.model import TransformerLM

    if not isinstance(model, TransformerLM):
        raise ExportError("model", f"expected a plyx.model.TransformerLM, got {type(model).__name__}",
                          fix="load one with plyx.model.load_checkpoint(path)")
    arch = check_gguf(model.config, outtype)
    gguf = require("gguf", extra="gguf")
    if verify:
        require("transformers", extra="gguf")
        require("accelerate", extra="gguf")  # transformers' GGUF loader needs it
    source_dir = _check_source(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model-{outtype}.gguf"
    tokenizer_json = None if source_dir is None else source_dir / "tokenizer.json"
    read_bpe(tokenizer_json, model.config.vocab_size)  # a tokenizer GGUF cannot hold fails before any work
    written = _write(gguf, model, path, arch, outtype, tokenizer_json, _card_name(source_dir, model.config))
    report, quality = (verify_gguf(path, model, written, atol=atol, rtol=rtol) if verify else (None, None))
    settings = {"format": "gguf", "outtype": outtype, "architecture": arch, "file": path.name,
                "tensor_types": written["types"], "tokenizer": written["tokenizer"],
                "special_tokens": written["special"], "quantization_error": quality,
                "quant_tolerance": dict(zip(("atol", "rtol"), QUANT_TOLERANCES[outtype]))}
    manifest = out / MANIFEST_FILE
    manifest.write_text(json.dumps(_manifest(model.config, settings, source_dir, report, exporter="gguf.GGUFWriter",
                                             packages=("gguf", "transformers")), indent=2) + "\n", encoding="utf-8")
    return ExportResult(format="gguf", path=out, files=[path, manifest], model=path, manifest=manifest,
                        verification=report, settings=settings)


def _card_name(source: Path | None, config: Any) -> str:
    if source is not None:
        from plyx.model import CheckpointError, open_checkpoint

        try:
            name = open_checkpoint(source).card.name
            if name:
                return str(name)
        except CheckpointError:
            pass
    return f"plyx-{config.arch}"


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names (``model.layers.0...``, ``lm_head.weight``), float32."""
    return {(n if n.startswith("lm_head.") else f"model.{n}"): t.detach().float().cpu()
            for n, t in model.state_dict().items()}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (``convert_hf_to_gguf.LlamaModel.permute``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    # (H, 2, Dh/2, D) -> (H, Dh/2, 2, D): each head's two rotary halves interleaved
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def unpermute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """The inverse of ``permute`` (transformers' ``_reverse_permute_weights``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write(gguf: Any, model: nn.Module, path: Path, arch: str, outtype: str, tokenizer_json: Path | None,
           name: str) -> dict[str, Any]:
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.n_layers)
    file_type = gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_key_length(c.dim_per_head)
    writer.add_value_length(c.dim_per_head)
    writer.add_rope_dimension_count(c.dim_per_head)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.norm_eps))
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer, special = _add_tokenizer(gguf, writer, tokenizer_json, c.vocab_size)

    types: dict[str, str] = {}
    for hf, tensor in hf_state(model).items():
        if hf == "lm_head.weight" and c.tie_embeddings:
            continue
        target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ExportError("model", f"tensor {hf!r} has no llama.cpp name in the {arch} architecture",
                              fix="report the model config to plyx")
        data = tensor.numpy()
        if arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            data = permute(data, c.n_heads, c.n_heads if "q_proj" in hf else c.kv_heads)
        qtype = _tensor_type(gguf, data, outtype)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        types[target] = qtype.name
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
    finally:
        writer.close()
    return {"types": types, "tokenizer": tokenizer, "special": special}


def _tensor_type(gguf: Any, data: np.ndarray, outtype: str) -> Any:
    """f32 for vectors (norms, biases), the outtype for matrices; q8_0 needs rows in whole blocks of 32."""
    q = gguf.GGMLQuantizationType
    if data.ndim < 2:
        return q.F32
    if outtype == "q8_0" and data.shape[-1] % _BLOCK == 0:
        return q.Q8_0
    return q.F16


def read_bpe(tokenizer_json: Path | None, vocab_size: int
             ) -> tuple[dict[str, Any], dict[str, int], dict[str, int], set[str]] | None:
    """``(model, vocab with added tokens, added tokens, special tokens)`` of a byte-level BPE ``tokenizer.json``;
    None without one; ``ExportError`` for another kind of tokenizer or ids beyond ``vocab_size``."""
    if tokenizer_json is None or not tokenizer_json.is_file():
        return None
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    bpe = data.get("model") or {}
    pre = json.dumps(data.get("pre_tokenizer") or {})
    if bpe.get("type") != "BPE" or "ByteLevel" not in pre:
        raise ExportError("format", "format 'gguf' writes byte-level BPE tokenizers (llama.cpp's gpt2 model); "
                          f"this tokenizer.json is {bpe.get('type')} with pre-tokenizer {pre[:80]}", value="gguf",
                          fix="export to onnx or hf, which copy the tokenizer files as they are")
    vocab: dict[str, int] = dict(bpe.get("vocab") or {})
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    vocab.update(added)
    if max(vocab.values(), default=-1) >= vocab_size:
        raise ExportError("format", f"the tokenizer has ids up to {max(vocab.values())}, beyond the model's "
                          f"vocab_size {vocab_size}", value="gguf", fix="export the checkpoint the tokenizer belongs to")
    return bpe, vocab, added, specials


def _add_tokenizer(gguf: Any, writer: Any, tokenizer_json: Path | None, vocab_size: int
                   ) -> tuple[dict[str, Any] | None, dict[str, int | None]]:
    """Tokens, merges and types of a byte-level BPE ``tokenizer.json`` (llama.cpp's ``gpt2`` model)."""
    special = special_tokens(tokenizer_json)
    read = read_bpe(tokenizer_json, vocab_size)
    if read is None:
        return None, special.ids()
    bpe, vocab, added, specials = read
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # llama.cpp wants one entry per embedding row; the rest are unused padding
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if token in specials else
                         gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if special.bos_id is not None:
        writer.add_bos_token_id(special.bos_id)
    if special.eos_id is not None:
        writer.add_eos_token_id(special.eos_id)
    if special.pad_id is not None:
        writer.add_pad_token_id(special.pad_id)
    writer.add_add_bos_token(False)
    return {"model": "gpt2", "tokens": len(tokens), "merges": len(merges), "real_tokens": len(vocab)}, special.ids()


def file_state(path: Path, model: nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """The file's tensors, dequantised and back in plyx names and layout (gguf's reader)."""
    gguf = require("gguf", extra="gguf")
    c = model.config
    reader = gguf.GGUFReader(str(path))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.n_layers)
    back = {}
    for hf in hf_state(model):
        target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        back[target] = hf
    state = {}
    for t in reader.tensors:
        hf = back.get(t.name)
        if hf is None:
            raise ExportVerificationError(f"the GGUF file holds a tensor {t.name!r} plyx did not write", report=None,
                                          fix="the export was not kept; report it to plyx")
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            data = unpermute(data, c.n_heads, c.n_heads if "q_proj" in hf else c.kv_heads)
        state[hf.removeprefix("model.")] = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy
    return state


def _check_metadata(path: Path, model: nn.Module, arch: str, written: dict[str, Any]) -> None:
    gguf = require("gguf", extra="gguf")
    c = model.config
    reader = gguf.GGUFReader(str(path))

    def value(key: str) -> Any:
        field = reader.get_field(key)
        if field is None:
            raise ExportVerificationError(f"the GGUF file has no {key!r}", report=None,
                                          fix="the export was not kept; report it to plyx")
        return field.contents()

    expected = {"general.architecture": arch, f"{arch}.context_length": c.max_seq_len,
                f"{arch}.embedding_length": c.d_model, f"{arch}.block_count": c.n_layers,
                f"{arch}.feed_forward_length": c.d_ff, f"{arch}.attention.head_count": c.n_heads,
                f"{arch}.attention.head_count_kv": c.kv_heads, f"{arch}.attention.key_length": c.dim_per_head,
                f"{arch}.rope.dimension_count": c.dim_per_head, f"{arch}.vocab_size": c.vocab_size}
    for key, want in expected.items():
        got = value(key)
        if got != want:
            raise ExportVerificationError(f"the GGUF file's {key} is {got!r}, the model's {want!r}", report=None,
                                          fix="the export was not kept; report it to plyx")
    for key, want in ((f"{arch}.rope.freq_base", c.rope_theta), (f"{arch}.attention.layer_norm_rms_epsilon", c.norm_eps)):
        if abs(float(value(key)) - float(want)) > 1e-6 * abs(float(want)):  # stored as float32
            raise ExportVerificationError(f"the GGUF file's {key} is {value(key)}, the model's {want}", report=None,
                                          fix="the export was not kept; report it to plyx")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    if types != written["types"]:
        missing = sorted(set(written["types"]) ^ set(types))
        raise ExportVerificationError(f"the GGUF file's tensors differ from those written (names {missing[:4]} or "
                                      "types)", report=None, fix="the export was not kept; report it to plyx")
    if written["tokenizer"] is not None and len(value("tokenizer.ggml.tokens")) != c.vocab_size:
        raise ExportVerificationError("the GGUF token list does not have vocab_size entries", report=None,
                                      fix="the export was not kept; report it to plyx")


def verify_gguf(path: str | os.PathLike[str], model: nn.Module, written: dict[str, Any], *, atol: float | None = None,
                rtol: float | None = None, seed: int | None = None) -> tuple[VerificationReport, dict[str, Any]]:
    """Read ``path`` back and check it (see the module doc).

    Returns:
        the report (transformers' GGUF loader against plyx with the file's weights) and the
        quantisation error (the file's logits against the original model's).
    """
    transformers = require("transformers", extra="gguf")
    path = Path(path)
    c = model.config
    arch = check_gguf(c, "f16")
    outtype = "q8_0" if any(v == "Q8_0" for v in written["types"].values()) else "f16"
    _check_metadata(path, model, arch, written)
    # plyx's model holding exactly the file's weights
    reloaded = copy.deepcopy(model).float().eval()
    state = file_state(path, model, arch)
    if c.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = reloaded.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (c.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ExportVerificationError(f"the GGUF file's tensors do not fill the model: missing {missing[:4]}, "
                                      f"unexpected {unexpected[:4]}", report=None,
                                      fix="the export was not kept; report it to plyx")
    kwargs: dict[str, Any] = {"gguf_file": path.name, "dtype": torch.float32}
    if arch == "qwen3":
        # transformers' GGUF loader reads no head_dim for qwen3 (its default is 128); the file has it as
        # attention.key_length (checked above), so the config is handed over and only the tensors come from the file
        from plyx.model import config_to_hf

        kwargs["config"] = transformers.AutoConfig.for_model(**config_to_hf(c))
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs).eval()
    except Exception as exc:  # transformers raises many types
        raise ExportVerificationError(f"transformers' GGUF loader cannot load {path.name}: {type(exc).__name__}: "
                                      f"{exc}", report=None, fix="the export was not kept; report it to plyx") from exc
    seed = secrets.randbits(31) if seed is None else int(seed)
    f32_atol, f32_rtol = DEFAULT_TOLERANCES["float32"]
    q_atol, q_rtol = QUANT_TOLERANCES[outtype]
    q_atol = q_atol if atol is None else float(atol)
    q_rtol = q_rtol if rtol is None else float(rtol)
    generator = torch.Generator().manual_seed(seed)
    checks, quant = [], []
    original = model.float() if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    for batch, seq_len in default_shapes(c.max_seq_len):
        ids = torch.randint(0, c.vocab_size, (batch, seq_len), generator=generator)  # (B, T)
        with torch.no_grad(), reference_kernels():
            file_logits = reloaded(ids).float()  # (B, T, V)
            original_logits = original(ids).float()
            got = hf(ids).logits.float()
        checks.append(_compare(batch, seq_len, got, file_logits, f32_atol, f32_rtol))
        q = _compare(batch, seq_len, file_logits, original_logits, q_atol, q_rtol)
        top1 = float((file_logits.argmax(-1) == original_logits.argmax(-1)).float().mean())
        quant.append({**q.to_dict(), "top1_agreement": top1})
    report = VerificationReport(runtime=f"transformers {version_of('transformers')} GGUF loader, gguf "
                                        f"{version_of('gguf')} reader", dtype=outtype, atol=f32_atol, rtol=f32_rtol,
                                seed=seed, checks=checks, graph="gguf")
    bad = next((ch for ch in checks if not ch.passed), None)
    if bad is not None:
        raise ExportVerificationError(
            f"transformers' GGUF loader gives other logits than plyx with the file's weights at input_ids "
            f"[{bad.batch}, {bad.seq_len}]: max abs error {bad.max_abs_error:.3g} > tolerance {bad.tolerance:.3g} "
            f"(layout or metadata error, not quantisation), seed {seed}", report=report,
            fix="the export was not kept; report the model config to plyx")
    worst = next((q for q in quant if not q["passed"]), None)
    if worst is not None:
        fix = ("the export was not kept; use --outtype f16, or raise --atol/--rtol if this loss is acceptable"
               if outtype == "q8_0" else "the export was not kept; report the model config to plyx")
        raise ExportVerificationError(
            f"the file's weights, read as llama.cpp reads them ({outtype}), give logits far from the original "
            f"model's at input_ids [{worst['batch']}, {worst['seq_len']}]: max abs error {worst['max_abs_error']:.3g} "
            f"> tolerance {worst['tolerance']:.3g} (atol {q_atol:g} + rtol {q_rtol:g} * max|logits|; quantisation "
            f"loss or a tensor layout error), seed {seed}", report=report, fix=fix)
    return report, {"checks": quant, "atol": q_atol, "rtol": q_rtol}
