"""Errors of plyx-model: each names the file or tensor, what was found, what was expected and the fix."""

from __future__ import annotations

from plyx.specs.errors import PlyxError

__all__ = ["CheckpointError", "CheckpointIntegrityError", "CheckpointMismatchError", "UnsupportedArchitectureError"]


class CheckpointError(PlyxError, ValueError):
    """A checkpoint directory cannot be read as a plyx or Hugging Face checkpoint."""


class CheckpointIntegrityError(CheckpointError):
    """A shard is truncated, corrupted or tampered with (size or sha256 differs from the card).

    Attributes:
        shard: the file name. expected, found: sizes or digests.
    """

    def __init__(self, shard: str, problem: str, *, expected: object = None, found: object = None) -> None:
        self.shard, self.expected, self.found = shard, expected, found
        super().__init__(
            f"checkpoint shard {shard!r} {problem}; the file was truncated or modified after it was written: "
            f"restore it from the source (or re-save the checkpoint)"
        )


class CheckpointMismatchError(CheckpointError):
    """The tensors of a checkpoint do not fit the model its configuration builds.

    Attributes:
        problems: one line per tensor: missing, unexpected, or ``name: checkpoint [..] vs model [..]``.
    """

    def __init__(self, problems: list[str], *, source: str = "") -> None:
        self.problems = problems
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        super().__init__(
            f"checkpoint {source} does not match its model configuration:\n  {shown}\n"
            f"check that config (vocab_size, d_model, n_heads, n_kv_heads, head_dim, d_ff, n_layers, "
            f"tie_embeddings, qkv_bias, qk_norm) is the one the weights were trained with"
        )


class UnsupportedArchitectureError(CheckpointError):
    """``config.json`` names an architecture plyx does not implement."""
