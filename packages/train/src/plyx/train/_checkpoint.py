"""Training checkpoints: the model (a plyx ``Checkpoint`` directory) plus everything needed to resume exactly.

One directory per saved step::

    checkpoints/step-000100/
        model_card.json, *.safetensors   plyx.model.save_checkpoint: loadable by plyx-serve as is
        tokenizer.json                   the run's tokenizer, so the directory is self-contained
        tokenizer_config.json            its EOS token and default chat template (plyx serve reads it)
        trainer_state.safetensors        optimizer tensors, torch/CUDA RNG states
        trainer_state.json               step, data position, scheduler, python/numpy RNG, config, metrics
    checkpoints/latest -> step-000100

Everything is written into a hidden temporary directory which is renamed into
place only when complete (``rename`` is atomic on POSIX), so a crash or a kill
mid-save leaves the previous checkpoint intact. No pickle: tensors go to
safetensors and the rest to JSON (Python's float repr round-trips exactly).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "CheckpointManager",
    "ResumeError",
    "capture_rng",
    "restore_rng",
    "optimizer_to_flat",
    "optimizer_from_flat",
    "STATE_JSON",
    "STATE_TENSORS",
]

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
STATE_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


class ResumeError(ValueError):
    """A checkpoint cannot be resumed by this run (another model, missing files); the message says why and what to do."""


# -- RNG ---------------------------------------------------------------------------
def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON part, tensor part) of the python, numpy, torch and CUDA generator states."""
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    json_part = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    return json_part, tensors


def restore_rng(json_part: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    version, internal, gauss = json_part["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        states = [tensors[k] for k in cuda][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


# -- optimizer state without pickle ---------------------------------------------
def optimizer_to_flat(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split ``optimizer.state_dict()`` into JSON-able scalars and named tensors."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return {"param_groups": state["param_groups"], "scalars": scalars}, tensors


def optimizer_from_flat(json_part: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    for index, entry in json_part["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    groups = []
    for group in json_part["param_groups"]:
        group = dict(group)
        if isinstance(group.get("betas"), list):  # JSON has no tuples
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return {"state": state, "param_groups": groups}


# -- the manager ------------------------------------------------------------------
class CheckpointManager:
    """Saves, lists, rotates and loads the checkpoints of one run directory.

    Args:
        root: ``<out_dir>/checkpoints``.
        keep: how many of the newest checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = max(1, int(keep))

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir() and not child.is_symlink() and (child / STATE_JSON).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        *,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: dict[str, Any],
        card_fields: dict[str, Any] | None = None,
        tokenizer_file: Path | None = None,
        extra_files: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` atomically and return its directory.

        Args:
            state: JSON-able trainer state (step, data position, config, metrics...);
                RNG, optimizer and scheduler states are added here.
            extra_files: file name -> JSON document written into the checkpoint (``tokenizer_config.json``).
        """
        from plyx.model import save_checkpoint  # the model's own format, loadable by serve/export

        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_checkpoint(model, tmp, card_fields=card_fields)
        if tokenizer_file is not None and tokenizer_file.is_file():
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        for name, doc in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        rng_json, rng_tensors = capture_rng()
        optim_json, optim_tensors = optimizer_to_flat(optimizer.state_dict())
        save_file({**optim_tensors, **rng_tensors}, str(tmp / STATE_TENSORS))
        doc = {
            "format": STATE_FORMAT,
            **state,
            "step": step,
            "rng": rng_json,
            "optimizer": optim_json,
            "scheduler": scheduler.state_dict(),
        }
        (tmp / STATE_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        return self.commit(tmp, step)

    def commit(self, tmp: Path, step: int) -> Path:
        """Rename a complete temporary checkpoint directory into place as ``step``, point ``latest`` at it
        and drop the checkpoints beyond ``keep``; returns the step's directory.

        Writers other than ``save`` (plyx-dist's sharded checkpoints) call it once ``tmp`` holds
        ``trainer_state.json``, which they write last.
        """
        final = self.path_for(step)
        self._commit(tmp, final)
        self._point_latest(final)
        self._rotate()
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        old = None
        if final.exists():  # the same step saved again (a resumed run): swap, then drop the old one
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _point_latest(self, final: Path) -> None:
        link = self.root / "latest"
        tmp = self.root / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        try:
            tmp.symlink_to(final.name)
            os.replace(tmp, link)
        except OSError:  # filesystems without symlinks: `latest()` finds the newest by name anyway
            tmp.unlink(missing_ok=True)

    def _rotate(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)

    # -- loading ----------------------------------------------------------------
    @staticmethod
    def resolve(path: str | os.PathLike[str]) -> Path:
        """A checkpoint directory from a step directory, a ``checkpoints`` directory or a run directory."""
        p = Path(path)
        if (p / STATE_JSON).is_file():
            return p.resolve()
        for root in (p, p / "checkpoints"):
            latest = CheckpointManager(root).latest()
            if latest is not None:
                return latest
        raise ResumeError(
            f"no resumable checkpoint at {str(p)!r} (looked for {STATE_JSON} in it, in its step-* "
            f"directories and in {p / 'checkpoints'}); pass a checkpoint directory or a run directory"
        )

    @staticmethod
    def read_state(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The JSON and tensor parts of a checkpoint's trainer state."""
        try:
            doc = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
            tensors = load_file(str(path / STATE_TENSORS))
        except (OSError, json.JSONDecodeError) as exc:
            raise ResumeError(f"checkpoint {str(path)!r} is unreadable ({exc}); resume from an older one") from None
        if doc.get("format") != STATE_FORMAT:
            raise ResumeError(
                f"checkpoint {str(path)!r} has trainer-state format {doc.get('format')!r}; this plyx-train "
                f"reads format {STATE_FORMAT}"
            )
        return doc, tensors
