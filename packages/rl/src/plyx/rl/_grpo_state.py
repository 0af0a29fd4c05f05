"""Resumable GRPO state: policy, optimizer, scheduler, prompt sampler, RNG and counters, written atomically.

Layout: ``out_dir/state/step-00000042/`` holding ``policy.safetensors``, ``optimizer.safetensors``
(every tensor of the optimizer's state, flattened as ``state.<param index>.<name>``), ``rng.safetensors``
(torch's generator states) and ``trainer_state.json`` (step, sampler position, scheduler, counters, the
optimizer's param groups and non-tensor state). A checkpoint is written in a temporary sibling directory
and renamed into place, so a kill at any moment leaves either the previous checkpoint or the new one,
never a half-written one; older checkpoints are removed after the new one lands. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["PromptSampler", "latest_state", "load_state", "save_state"]


class PromptSampler:
    """Prompt indices in a seeded order, reshuffled every epoch; its position is part of the run's state."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next ``k`` prompt indices (crossing into the next epoch as needed)."""
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's prompt sampler saw {state['n']} prompts with seed {state['seed']}; "
                             f"this run has {self.n} with seed {self.seed}: resume with the same data and seed")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors stores each tensor once: tied / non-contiguous views become contiguous copies."""
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def _split_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for idx, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value
            else:
                rest.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": rest}


def _join_optimizer(tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, entries in doc["scalars"].items():
        state.setdefault(int(idx), {}).update(entries)
    return {"state": state, "param_groups": doc["param_groups"]}


def save_state(root: Path, step: int, policy: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               sampler: PromptSampler, counters: dict[str, Any]) -> Path:
    """Write the checkpoint of ``step`` under ``root`` atomically; returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_contiguous(dict(policy.state_dict())), str(tmp / "policy.safetensors"))
    opt_tensors, opt_doc = _split_optimizer(optimizer.state_dict())
    save_file(_contiguous(opt_tensors), str(tmp / "optimizer.safetensors"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    save_file(rng, str(tmp / "rng.safetensors"))
    doc = {"step": step, "sampler": sampler.state_dict(), "scheduler": scheduler.state_dict(),
           "optimizer": opt_doc, "counters": counters}
    (tmp / "trainer_state.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for f in tmp.iterdir():  # the bytes on disk before the rename makes them the checkpoint
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_state(root: Path) -> Path | None:
    """The newest complete checkpoint directory under ``root`` (temporary ones are ignored), or None."""
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def load_state(path: Path, policy: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
               sampler: PromptSampler) -> tuple[int, dict[str, Any]]:
    """Restore everything ``save_state`` wrote; returns ``(step, counters)``."""
    doc = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    weights = load_file(str(path / "policy.safetensors"), device=str(next(policy.parameters()).device))
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k in dict(policy.named_parameters())]:
        raise ValueError(f"{path}: the checkpoint's policy does not fit this model (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}); resume with the same model")
    opt = load_file(str(path / "optimizer.safetensors"))
    optimizer.load_state_dict(_join_optimizer(opt, doc["optimizer"]))
    scheduler.load_state_dict(doc["scheduler"])
    sampler.load_state_dict(doc["sampler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    return int(doc["step"]), dict(doc["counters"])
