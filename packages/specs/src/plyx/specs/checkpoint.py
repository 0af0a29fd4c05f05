"""The ``Checkpoint`` + ``ModelCard`` contract.

A checkpoint directory holds safetensors shards, an index mapping each tensor
to its shard, and ``model_card.json``: a versioned ``ModelCard`` whose
``version`` gates the loader (newer cards are refused with an upgrade hint,
older ones migrated). No pickle anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
from plyx.specs._versions import CONTRACT_VERSIONS
from plyx.specs.config._base import ConfigBase, migration
from plyx.specs.config.model import ModelConfig

__all__ = ["CONTRACT_VERSION", "Checkpoint", "ModelCard", "TensorEntry", "CARD_FILE", "INDEX_FILE"]

CONTRACT_VERSION = CONTRACT_VERSIONS["checkpoint"]
CARD_FILE = "model_card.json"
INDEX_FILE = "model.safetensors.index.json"


class TensorEntry(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where one tensor lives and what it looks like."""

    shard: str
    """File name of the safetensors shard holding it."""
    shape: list[int]
    """Its shape."""
    dtype: str
    """Canonical dtype name."""


class ModelCard(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Machine-readable description of a checkpoint (the human card is written by plyx-governance).

    Version 2 added ``shard_bytes`` (the size of each shard, so a truncated file
    is named with both sizes before any hashing) and ``num_params``; v1 cards
    are migrated on load (``num_params`` is computed from ``tensors``; sizes of
    a migrated card are unknown, so only the digests are checked).
    """

    SCHEMA = "model_card"
    VERSION = 2

    name: str = "plyx-model"
    """Model name."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The architecture the weights belong to."""
    layout: Literal["plyx", "hf"] = "plyx"
    """Tensor naming: plyx's own or Hugging Face's."""
    dtype: str = "float32"
    """dtype of the stored weights."""
    tensors: dict[str, TensorEntry] = {}
    """Every tensor by name."""
    shards: dict[str, str] = {}
    """Shard file name -> sha256 hex digest, verified on load."""
    shard_bytes: dict[str, int] = {}
    """Shard file name -> size in bytes (v2); empty when unknown (a migrated v1 card)."""
    num_params: int = 0
    """Number of parameters stored (each tensor once) (v2)."""
    created: str = ""
    """ISO 8601 UTC time of writing."""
    producers: dict[str, str] = {}
    """Distribution -> version of the plyx planes that wrote it."""
    training: dict[str, Any] = {}
    """Free-form training summary (steps, tokens, final losses)."""
    tokenizer: str = ""
    """Tokenizer file name inside the checkpoint directory, if bundled."""
    license: str = ""
    """SPDX licence id of the weights."""
    description: str = ""
    """One paragraph for people."""


@runtime_checkable
class Checkpoint(Protocol):
    """An opened checkpoint directory."""

    @property
    def path(self) -> Path:
        """The directory."""
        ...

    @property
    def card(self) -> ModelCard:
        """Its model card (migrated to the current version)."""
        ...

    def tensor_names(self) -> list[str]:
        """Every stored tensor name."""
        ...

    def load_tensor(self, name: str, device: str = "cpu") -> Any:
        """One tensor, read lazily from its shard."""
        ...

    def load_state_dict(self, device: str = "cpu") -> Mapping[str, Any]:
        """Every tensor by name."""
        ...

    def verify(self) -> None:
        """Recompute shard digests; raise naming the shard that does not match."""
        ...


@migration("model_card", 1)
def _model_card_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """v2 added ``shard_bytes`` (unknown for v1: left empty) and ``num_params`` (summed from ``tensors``)."""
    out = dict(doc)
    out.setdefault("shard_bytes", {})
    if "num_params" not in out:
        total = 0
        for entry in (out.get("tensors") or {}).values():
            count = 1
            for size in entry.get("shape", []) if isinstance(entry, dict) else []:
                count *= int(size)
            total += count
        out["num_params"] = total
    return out
