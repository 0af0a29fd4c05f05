"""Typed payloads of the lifecycle hooks: what a checkpoint or an export was made with.

``plyx_on_checkpoint_saved`` and ``plyx_on_export_written`` take a ``metadata``
argument; these frozen structs are its typed form. An emitter may pass the
struct itself or ``payload_dict(struct)`` (a plain dict, which older plugins
expect); a consumer reads either with ``checkpoint_payload`` / ``export_payload``,
which validate a dict and name the offending field.

``Techniques`` is what a reproducibility receipt records about *how* an
artifact was produced, beyond its config: the kernel the registry chose for
each op (name, implementation, distribution and version, device, dtype),
precision, compilation, attention backend, parallelism, optimizer, a
fingerprint of the data, and, for serving receipts, the decoding settings.

Example:
    >>> t = Techniques(precision="bf16", kernels=(KernelChoice(op="rmsnorm", implementation="triton"),))
    >>> payload_dict(CheckpointPayload(run_id="r1", techniques=t))["techniques"]["precision"]
    'bf16'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from plyx.specs.errors import ConfigError

__all__ = [
    "CONTRACT_VERSION",
    "KernelChoice",
    "Techniques",
    "CheckpointPayload",
    "ExportPayload",
    "checkpoint_payload",
    "export_payload",
    "payload_dict",
]

CONTRACT_VERSION = "1.0"


class KernelChoice(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The implementation the kernel registry selected for one op."""

    op: str
    """Symbolic kernel name (``rmsnorm``, ``attention``, ``cross_entropy``...)."""
    implementation: str
    """The chosen implementation's name (``KernelImpl.qualname``)."""
    distribution: str = ""
    """Distribution that registered it (``plyx-kernel``, a third-party plugin); "" when unknown."""
    version: str = ""
    """That distribution's version."""
    device: str = ""
    """Device type it ran on (``cuda``, ``cpu``...)."""
    dtype: str = ""
    """Canonical dtype it ran in (``bfloat16``...)."""


class Techniques(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How an artifact was produced; every field is optional ("" / empty: not recorded)."""

    kernels: tuple[KernelChoice, ...] = ()
    """One entry per op the registry resolved."""
    precision: str = ""
    """Numeric precision: ``fp32`` | ``bf16`` | ``fp16`` | ``bf16-mixed`` | ``fp8``..."""
    compile: str = ""
    """"" for eager, else the compiler and mode (``inductor:max-autotune``, ``cuda-graphs``)."""
    attention_backend: str = ""
    """Attention backend used (``sdpa``, ``flash``, ``paged``, a plugin's name)."""
    parallelism: dict[str, int] = {}
    """Degrees of each parallel dimension (``{"dp": 8, "tp": 2}``); empty for one device."""
    parallel_strategy: str = ""
    """The strategy that applied them (``ddp``, ``fsdp2``...)."""
    optimizer: str = ""
    """Optimizer name as registered (``adamw``, ``muon``...)."""
    data_fingerprint: str = ""
    """``sha256:<hex>`` of the training data (or of its manifest)."""
    decoding: dict[str, Any] = {}
    """Serving only: ``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``, speculative settings..."""
    extra: dict[str, Any] = {}
    """Anything else a plugin wants recorded (keys namespaced by the plugin's name)."""


class CheckpointPayload(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``metadata`` of ``plyx_on_checkpoint_saved``."""

    writer: str = ""
    """What wrote the checkpoint: ``trainer``, ``save_checkpoint``, ``save_hf``..."""
    config: dict[str, Any] = {}
    """The run's config (model, optimizer, schedule...) as a dict."""
    seeds: dict[str, int] = {}
    """Seeds by library (``python``, ``torch``, ``numpy``)."""
    inputs: dict[str, str] = {}
    """Name -> path of what was consumed (``train_data``, ``tokenizer``...)."""
    outputs: list[str] | dict[str, str] = []
    """Paths written (a list, or role -> path); empty means every file of the checkpoint directory."""
    metrics: dict[str, float] = {}
    """Metrics at that step."""
    run_id: str = ""
    """The run's id."""
    accelerator: dict[str, Any] = {}
    """What the emitter knows of its devices (name, count, driver)."""
    techniques: Techniques | None = None
    """How it was produced (kernels, precision, ...)."""


class ExportPayload(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``metadata`` of ``plyx_on_export_written``."""

    artifacts: list[str] = []
    """The exported files; empty means every file of the export directory."""
    source: str = ""
    """The checkpoint it was exported from."""
    config: dict[str, Any] = {}
    """Export options (opset, dtype, sequence length...)."""
    name: str = ""
    """Release name."""
    card: dict[str, Any] = {}
    """Model card fields (``license``, ``intended_use``, ``eval_metrics``...)."""
    techniques: Techniques | None = None
    """How the export was produced."""


def payload_dict(payload: msgspec.Struct | Mapping[str, Any] | None) -> dict[str, Any]:
    """A payload as a plain dict (structs converted recursively; mappings copied; None -> {})."""
    if payload is None:
        return {}
    if isinstance(payload, msgspec.Struct):
        return dict(msgspec.to_builtins(payload))
    return dict(payload)


def _convert(value: Any, kind: type[Any], what: str) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return msgspec.convert(dict(value or {}), kind, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `int`, got `str` - at `$.seeds.torch`": keep its path
        problem, sep, where = str(exc).partition(" - at `")
        path = where.rstrip("`") if sep else "$"
        raise ConfigError(f"{what}{path[1:]}", problem,
                          fix=f"pass a plyx.specs.payloads.{kind.__name__} or a dict of its fields") from None


def checkpoint_payload(metadata: CheckpointPayload | Mapping[str, Any] | None) -> CheckpointPayload:
    """Validate ``plyx_on_checkpoint_saved`` metadata (a struct or a dict) into a ``CheckpointPayload``.

    Raises:
        ConfigError: naming the field (``metadata.seeds.torch``) and the expected type.
    """
    return _convert(metadata, CheckpointPayload, "metadata")


def export_payload(metadata: ExportPayload | Mapping[str, Any] | None) -> ExportPayload:
    """Validate ``plyx_on_export_written`` metadata; keys that are not payload fields go to ``card``."""
    if isinstance(metadata, ExportPayload):
        return metadata
    raw = dict(metadata or {})
    fields = set(ExportPayload.__struct_fields__)
    card = {**dict(raw.pop("card", None) or {}), **{k: raw.pop(k) for k in list(raw) if k not in fields}}
    return _convert({**raw, "card": card}, ExportPayload, "metadata")
