"""``ServeConfig``: the inference engine and the HTTP server."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from plyx.specs.config._base import ConfigBase
from plyx.specs.errors import ConfigError

__all__ = ["ServeConfig"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class ServeConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How ``plyx serve`` runs a model."""

    SCHEMA = "serve"
    VERSION = 1

    model: str = ""
    """Path of a plyx checkpoint or a Hugging Face model directory."""
    served_name: str = ""
    """Model name reported by /v1/models; empty means the directory name."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    """TCP port (0 picks a free one)."""
    api_key: str = ""
    """Bearer token required on every request; empty disables auth."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; auto keeps the checkpoint's."""
    kv_cache: str = "paged"
    """KV cache kind (a plugin name): paged | contiguous | ..."""
    block_size: Pos = 16
    """Tokens per KV-cache block."""
    num_blocks: NonNeg = 0
    """Blocks in the pool; 0 sizes it from memory_fraction."""
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    """Share of free device memory given to the KV cache when num_blocks is 0."""
    max_batch_size: Pos = 64
    """Most sequences decoded in one step."""
    max_batch_tokens: Pos = 2048
    """Most tokens (prefill chunks + decodes) in one step."""
    max_model_len: NonNeg = 0
    """Longest prompt + completion; 0 means the model's max_seq_len."""
    prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes."""
    max_queue: Pos = 256
    """Waiting requests before new ones get HTTP 429."""
    max_request_bytes: Pos = 1_048_576
    """Largest request body accepted."""
    guardrail_policy: str = ""
    """Path of a plyx-safety policy; empty means none (needs plyx-safety)."""

    def check(self) -> None:
        if self.max_batch_tokens < self.max_batch_size:
            raise ConfigError(
                "max_batch_tokens",
                f"max_batch_tokens ({self.max_batch_tokens}) is below max_batch_size "
                f"({self.max_batch_size}): a full decode step would not fit",
                value=self.max_batch_tokens,
                fix="raise max_batch_tokens to at least max_batch_size",
            )
