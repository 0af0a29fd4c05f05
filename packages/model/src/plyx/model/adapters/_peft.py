"""PEFT interop: ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft`` reads and writes.

Tensor names in the file are PEFT's: ``base_model.model.`` + the Hugging Face module name +
``.lora_A.weight`` / ``.lora_B.weight`` / ``.lora_magnitude_vector`` (DoRA), e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. ``peft`` itself is not needed
here (it is the test oracle).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from plyx.model._hf_config import hf_name
from plyx.model._safetensors_io import atomic_directory
from plyx.model.adapters._api import _known, _state, adapter_layers, add_adapter, delete_adapter
from plyx.model.adapters._config import LoraConfig, _pattern
from plyx.model.adapters._errors import AdapterError, AdapterMismatchError
from plyx.model.adapters._variants import get_variant
from torch import nn

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "load_peft", "save_peft"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."

#: adapter_config.json fields whose non-default values this loader does not implement: (default, why)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "bias": ("none", "trained biases are not part of plyx adapters; re-train with bias='none'"),
    "modules_to_save": (None, "fully trained extra modules are not adapters; merge them into the base checkpoint"),
    "fan_in_fan_out": (False, "Conv1D-style transposed weights do not occur in plyx models"),
    "rank_pattern": ({}, "per-module ranks are not implemented; re-train with one rank"),
    "alpha_pattern": ({}, "per-module alphas are not implemented; re-train with one lora_alpha"),
    "layers_to_transform": (None, "use a regex target_modules naming the layers instead"),
    "exclude_modules": (None, "use a regex target_modules that leaves those modules out"),
    "lora_bias": (False, "LoRA biases are not implemented"),
    "use_qalora": (False, "QA-LoRA is not implemented"),
    "layer_replication": (None, "layer replication is not implemented"),
    "trainable_token_indices": (None, "trainable tokens are not implemented"),
    "target_parameters": (None, "adapters on raw parameters are not implemented"),
}


def _file_name(path: str, key: str) -> str:
    """plyx module path + tensor key -> PEFT's name in ``adapter_model.safetensors``."""
    return _PREFIX + hf_name(f"{path}.{key}")


def _peft_targets(model: nn.Module, config: LoraConfig, paths: list[str]) -> list[str] | str:
    """``target_modules`` as PEFT matches them: the plain names as given, or, when any target is a regex,
    one regex that fullmatches exactly the adapted modules' Hugging Face names."""
    if all(_pattern(t) is None for t in config.target_modules):
        return list(config.target_modules)
    return "|".join(re.escape(hf_name(p)) for p in paths)


def save_peft(model: nn.Module, path: str | os.PathLike[str], name: str = "default", *,
              base_model_name_or_path: str | None = None) -> Path:
    """Write adapter ``name`` as a PEFT adapter directory (replaced atomically when it exists).

    ``peft.PeftModel.from_pretrained(hf_model, path)`` on the transformers twin of ``model`` (``save_hf``)
    then gives the same logits as ``model`` with the adapter active.

    Args:
        model: a model carrying adapter ``name``.
        path: the directory to write (``adapter_config.json``, ``adapter_model.safetensors``).
        name: the adapter to save.
        base_model_name_or_path: recorded in the config (where PEFT finds the base model).

    Returns:
        ``path``.
    """
    from safetensors.torch import save_file

    config = _known(model, name)
    variant = get_variant(config.variant)
    tensors: dict[str, torch.Tensor] = {}
    paths: list[str] = []
    for mod_path, layer in adapter_layers(model).items():
        if name in layer.variants:
            paths.append(mod_path)
            for key, p in layer.adapter_tensors(name).items():
                tensors[_file_name(mod_path, key)] = p.detach().to("cpu").contiguous()
    doc: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": _peft_targets(model, config, paths),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
        **variant.peft_flags(),
    }
    out = Path(path)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return out


def _read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory: it has no {CONFIG_FILE}; pass the directory "
                           f"that save_peft or peft's save_pretrained wrote")
    if not (path / WEIGHTS_FILE).is_file():
        extra = " (adapter_model.bin is a pickle, not loaded for safety: re-save it with safe_serialization=True)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}{extra}")
    try:
        doc = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{cfg_file} is not valid JSON ({exc}); re-save the adapter") from None
    if doc.get("peft_type") != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {doc.get('peft_type')!r} is not supported; plyx loads LORA adapters "
                           f"(lora, rslora, dora)")
    for field, (default, why) in _UNSUPPORTED.items():
        value = doc.get(field, default)
        if value != default and not (default in ({}, None, False) and not value):
            raise AdapterError(f"{cfg_file}: {field}={value!r} is not supported: {why}")
    return doc


def _config_from_peft(model: nn.Module, doc: dict[str, Any], variant: str | None) -> LoraConfig:
    targets = doc.get("target_modules")
    if targets == "all-linear":  # PEFT: every linear but the output layer
        names = {p.rsplit(".", 1)[-1] for p, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not p.startswith("lm_head") and ".lora_" not in p}
        target_modules: tuple[str, ...] = tuple(sorted(names))
    elif isinstance(targets, str):
        target_modules = ("re:" + targets,)
    elif isinstance(targets, list) and targets:
        target_modules = tuple(targets)
    else:
        raise AdapterError(f"adapter_config.json: target_modules {targets!r} must be a name list or a regex string")
    if variant is None:
        if doc.get("use_dora") and doc.get("use_rslora"):
            raise AdapterError("adapter_config.json: use_dora with use_rslora is not implemented; pass variant= "
                               "of a plugin that implements it")
        variant = "dora" if doc.get("use_dora") else "rslora" if doc.get("use_rslora") else "lora"
    return LoraConfig(r=int(doc["r"]), alpha=float(doc["lora_alpha"]), dropout=float(doc.get("lora_dropout") or 0.0),
                      target_modules=target_modules, variant=variant)


def load_peft(model: nn.Module, path: str | os.PathLike[str], name: str = "default", *,
              variant: str | None = None) -> None:
    """Load a PEFT LoRA adapter directory as adapter ``name`` (safetensors only; nothing is unpickled).

    The first adapter on a model becomes active (``add_adapter``). On any error the model is left as it was.

    Args:
        model: the base model the adapter was trained on.
        path: a directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
        name: the name the adapter gets on ``model``.
        variant: override the variant the config's flags select (``use_dora`` -> dora, ``use_rslora`` -> rslora).

    Raises:
        AdapterError: not a PEFT LoRA directory, or a config feature plyx does not implement (named).
        AdapterMismatchError: tensors missing, unexpected or of another shape (each named with both shapes).
    """
    from safetensors import safe_open

    p = Path(path)
    doc = _read_config(p)
    config = _config_from_peft(model, doc, variant)
    add_adapter(model, config, name)
    try:
        expected: dict[str, torch.Tensor] = {}
        for mod_path, layer in adapter_layers(model).items():
            if name in layer.variants:
                for key, param in layer.adapter_tensors(name).items():
                    expected[_file_name(mod_path, key)] = param
        problems: list[str] = []
        with safe_open(str(p / WEIGHTS_FILE), framework="pt") as f:
            by_name = {_without_adapter_name(k): k for k in f.keys()}
            for file_name, param in expected.items():
                src = by_name.pop(file_name, None)
                if src is None:
                    problems.append(f"{file_name}: missing from the file (the model's adapter has {list(param.shape)})")
                    continue
                shape = list(f.get_slice(src).get_shape())
                if shape != list(param.shape):
                    problems.append(f"{file_name}: file {shape} vs model {list(param.shape)}")
                    continue
                with torch.no_grad():
                    param.copy_(f.get_tensor(src))
            problems += [f"{k}: in the file but not in the model's adapter" for k in sorted(by_name.values())]
        if problems:
            raise AdapterMismatchError(problems, source=str(p))
    except BaseException:
        if name in _state(model).configs:
            delete_adapter(model, name)
        raise


def _without_adapter_name(key: str) -> str:
    """A file key without the adapter name older PEFT versions kept (``lora_A.default.weight`` -> ``lora_A.weight``)."""
    key = re.sub(r"\.(lora_A|lora_B)\.[^.]+\.weight$", r".\1.weight", key)
    return re.sub(r"\.lora_magnitude_vector\.[^.]+\.weight$", ".lora_magnitude_vector", key)
