"""Training metrics: gradient norms, the spectral-norm health probe, MFU, memory, and the CSV/TensorBoard sinks.

``metrics.csv`` has one row per logged step; its columns are fixed when the
run starts (base metrics, then one ``grad_norm/<group>`` column per layer) and
cells not measured at a step are left empty. A resumed run keeps the rows up
to its checkpoint's step and appends after them, so the file always reads as
one uninterrupted run.
"""

from __future__ import annotations

import csv
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "BASE_COLUMNS",
    "MetricsWriter",
    "layer_groups",
    "grad_norms_by_group",
    "spectral_ratios",
    "peak_memory_mb",
    "peak_flops",
    "SPECTRAL_RANGE",
]

BASE_COLUMNS = (
    "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "ms_per_step", "mfu", "peak_mem_mb",
    "val_loss", "val_ppl",
)

#: the MLP/attention spectral-norm ratio of a healthy layer stays inside this range
SPECTRAL_RANGE = (0.5, 2.0)

_LAYER = re.compile(r"^(.*?\.\d+)\.")

# dense bf16 tensor-core peaks, FLOP/s (vendor datasheets); MFU is measured against these
_GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


def layer_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters grouped per layer: ``layers.3.attn.wq.weight`` -> ``layers.3``; others by top module."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = _LAYER.match(name)
        key = m.group(1) if m else name.split(".")[0]
        groups.setdefault(key, []).append((name, p))
    return groups


def grad_norms_by_group(groups: Mapping[str, list[tuple[str, nn.Parameter]]]) -> dict[str, float]:
    """L2 norm of each group's gradients (one host sync for all of them)."""
    names, norms = [], []
    for key, params in groups.items():
        grads = [p.grad.detach().float().norm() for _, p in params if p.grad is not None]
        if grads:
            names.append(key)
            norms.append(torch.stack(grads).norm())
    if not norms:
        return {}
    values = torch.stack(norms).tolist()  # a CPU-GPU sync point: only on logging steps
    return dict(zip(names, values))


_MLP = ("mlp", "ffn", "feed_forward")
_ATTN = ("attn", "attention")


@torch.no_grad()
def spectral_ratios(groups: Mapping[str, list[tuple[str, nn.Parameter]]]) -> dict[str, float]:
    """Per layer: mean spectral norm of its MLP matrices over that of its attention matrices.

    A layer whose MLP has grown far larger (or smaller) in operator norm than
    its attention dominates the residual stream; ratios outside
    ``SPECTRAL_RANGE`` are worth a look. Layers without both kinds are skipped.
    """
    out: dict[str, float] = {}
    for key, params in groups.items():
        mlp, attn = [], []
        for name, p in params:
            if p.ndim != 2:
                continue
            parts = name.lower().split(".")
            if any(tag in part for part in parts for tag in _MLP):
                mlp.append(p)
            elif any(tag in part for part in parts for tag in _ATTN):
                attn.append(p)
        if mlp and attn:
            def mean_sigma(ws: list[nn.Parameter]) -> float:
                return float(torch.stack([torch.linalg.matrix_norm(w.float(), ord=2) for w in ws]).mean())

            denom = mean_sigma(attn)
            out[key] = mean_sigma(mlp) / denom if denom > 0 else math.inf
    return out


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource  # POSIX only
    except ImportError:
        return float("nan")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: ``override``, ``$PLYX_PEAK_FLOPS``, a known GPU, else None."""
    if override:
        return float(override)
    env = os.environ.get("PLYX_PEAK_FLOPS")
    if env:
        return float(env)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _GPU_PEAKS.items():
            if key in name:
                return value
    return None  # a CPU's peak is not knowable portably: MFU is left empty


class MetricsWriter:
    """Writes metric rows to ``metrics.csv`` and, when ``tensorboard`` is installed, to TensorBoard.

    Args:
        out_dir: the run directory.
        extra_columns: columns after ``BASE_COLUMNS`` (per-layer grad norms, spectral ratios).
        resume_step: keep existing rows up to this step (a resumed run); None starts a new file.
        tensorboard: write ``out_dir/tb`` event files.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], extra_columns: Iterable[str] = (), *, resume_step: int | None = None,
        tensorboard: bool = True,
    ) -> None:
        self.path = Path(out_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = list(BASE_COLUMNS) + [c for c in extra_columns if c not in BASE_COLUMNS]
        kept: list[dict[str, str]] = []
        if resume_step is not None and self.path.is_file():
            with self.path.open(newline="") as fh:
                kept = [row for row in csv.DictReader(fh) if row.get("step") and int(row["step"]) <= resume_step]
        with self.path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        self._fh = self.path.open("a", newline="")
        self._csv = csv.DictWriter(self._fh, fieldnames=self.columns, extrasaction="ignore")
        self.tb: Any = None
        if tensorboard:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(Path(out_dir) / "tb"), purge_step=resume_step)
            except ImportError:  # tensorboard is an optional extra
                self.tb = None

    def write(self, step: int, values: Mapping[str, float | None]) -> None:
        row = {"step": step, **{k: _fmt(v) for k, v in values.items() if k != "step"}}
        self._csv.writerow(row)
        self._fh.flush()
        if self.tb is not None:
            for key, value in values.items():
                if value is not None and key != "step" and math.isfinite(float(value)):
                    self.tb.add_scalar(key, float(value), step)

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return repr(float(value))  # repr round-trips a float exactly
