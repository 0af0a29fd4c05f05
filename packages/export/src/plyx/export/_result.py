"""What an export returns: the written files and, for ONNX, the verification figures."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ExportResult", "GreedyCheck", "ShapeCheck", "VerificationReport"]


@attrs.frozen
class ShapeCheck:
    """One comparison of the exported graph with the torch model on random token ids.

    Attributes:
        batch, seq_len: the ``input_ids`` shape ``[B, T]``.
        max_abs_error: ``max |onnx - torch|`` over every logit.
        max_rel_error: ``max_abs_error / max |torch|`` (relative to the logits' scale).
        max_abs_logit: ``max |torch|``, the scale the tolerance is relative to.
        tolerance: ``atol + rtol * max_abs_logit``.
        passed: ``max_abs_error <= tolerance`` and every logit finite.
    """

    batch: int
    seq_len: int
    max_abs_error: float
    max_rel_error: float
    max_abs_logit: float
    tolerance: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def summary(self) -> str:
        mark = "ok" if self.passed else "FAIL"
        return (f"[{self.batch}, {self.seq_len}]: max abs error {self.max_abs_error:.3g}, max rel error "
                f"{self.max_rel_error:.3g} (tolerance {self.tolerance:.3g}) {mark}")


@attrs.frozen
class GreedyCheck:
    """A greedy decode through the exported graph against plyx's own.

    Attributes:
        prompt: the prompt's token ids.
        tokens: new tokens decoded.
        onnx, torch: the ids each side chose.
        first_mismatch: index of the first differing new token; None when all are equal.
        min_margin: the smallest gap between the best and second-best torch logit over the
            steps (how close the decode came to a tie that rounding could flip).
    """

    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    tokens: int
    onnx: tuple[int, ...] = attrs.field(converter=tuple)
    torch: tuple[int, ...] = attrs.field(converter=tuple)
    first_mismatch: int | None
    min_margin: float

    @property
    def passed(self) -> bool:
        return self.first_mismatch is None and len(self.onnx) == len(self.torch) == self.tokens

    @property
    def agreement(self) -> float:
        """Fraction of new tokens equal up to the first mismatch (1.0 when all match)."""
        n = self.tokens if self.first_mismatch is None else self.first_mismatch
        return n / self.tokens if self.tokens else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "passed": self.passed, "agreement": self.agreement}

    def summary(self) -> str:
        if self.passed:
            return (f"greedy decode of {self.tokens} tokens: equal to plyx's "
                    f"(smallest top-2 logit margin {self.min_margin:.3g}) ok")
        return f"greedy decode of {self.tokens} tokens: differs from plyx's at token {self.first_mismatch} FAIL"


@attrs.frozen
class VerificationReport:
    """The exported graph run in onnxruntime against the torch model.

    Attributes:
        runtime: ``onnxruntime <version> (<provider>)``.
        dtype: dtype of the exported weights.
        atol, rtol: the tolerance: a shape passes when ``max_abs_error <= atol + rtol * max|logits|``.
        seed: seed of the random token ids (rerun with it to reproduce).
        checks: one ``ShapeCheck`` per ``[B, T]``.
        greedy: the greedy-decode comparison (KV-cache graphs), else None.
        graph: ``prefill`` or ``kv-cache``.
    """

    runtime: str
    dtype: str
    atol: float
    rtol: float
    seed: int
    checks: tuple[ShapeCheck, ...] = attrs.field(converter=tuple)
    greedy: GreedyCheck | None = None
    graph: str = "prefill"

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks) and (self.greedy is None or self.greedy.passed)

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error for c in self.checks), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((c.max_rel_error for c in self.checks), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "dtype": self.dtype, "atol": self.atol, "rtol": self.rtol,
                "seed": self.seed, "ok": self.ok, "max_abs_error": self.max_abs_error,
                "max_rel_error": self.max_rel_error, "checks": [c.to_dict() for c in self.checks],
                "graph": self.graph, "greedy": None if self.greedy is None else self.greedy.to_dict()}

    def summary(self) -> str:
        lines = [f"verified in {self.runtime} against torch ({self.dtype}, seed {self.seed}, "
                 f"atol {self.atol:g}, rtol {self.rtol:g}):"]
        lines += [f"  input_ids {c.summary()}" for c in self.checks]
        if self.greedy is not None:
            lines.append(f"  {self.greedy.summary()}")
        return "\n".join(lines)


def _paths(value: Any) -> tuple[Path, ...]:
    return tuple(Path(p) for p in value)


@attrs.frozen
class ExportResult:
    """The files of one export.

    Iterating yields every written file, so an ``ExportResult`` is also the
    "written paths" the ``plyx_exporters`` hook contract asks a factory to return.

    Attributes:
        format: ``onnx``, or the name of a third-party exporter.
        path: the export directory.
        files: every file written (absolute paths inside ``path``).
        model: the graph file (``model.onnx``); None for exporters that do not say.
        config: ``config.json`` (Hugging Face architecture config), when the model has an HF equivalent.
        manifest: ``plyx_export.json`` (plyx config, source card, graph signature, verification).
        tokenizer: tokenizer files copied from the source checkpoint.
        verification: the onnxruntime comparison; None when verification was turned off.
        settings: what the export was made with (opset, dtype, dynamic axes...), as recorded in the manifest.
    """

    format: str
    path: Path = attrs.field(converter=Path)
    files: tuple[Path, ...] = attrs.field(converter=_paths)
    model: Path | None = None
    config: Path | None = None
    manifest: Path | None = None
    tokenizer: tuple[Path, ...] = attrs.field(default=(), converter=_paths)
    verification: VerificationReport | None = None
    settings: Mapping[str, Any] = attrs.field(factory=dict)

    def __iter__(self) -> Iterator[Path]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def relocated(self, old: Path, new: Path) -> ExportResult:
        """The same result with every path under ``old`` moved under ``new`` (after the atomic rename)."""

        def move(p: Path | None) -> Path | None:
            if p is None:
                return None
            try:
                return new / Path(p).relative_to(old)
            except ValueError:
                return Path(p)

        return attrs.evolve(
            self, path=new, files=tuple(move(p) for p in self.files), model=move(self.model),
            config=move(self.config), manifest=move(self.manifest), tokenizer=tuple(move(p) for p in self.tokenizer),
        )
