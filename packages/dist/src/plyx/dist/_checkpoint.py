"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): atomic, resharded on load.

One directory per saved step, beside plain plyx-train checkpoints::

    checkpoints/step-000100/
        dcp/                         DCP: model and optimizer state, each rank writes its shards
        rng/rank-00001.safetensors   torch/CUDA generator states of each rank (+ .json: python, numpy)
        tokenizer.json               the run's tokenizer
        trainer_state.safetensors    rank 0's generator tensors (plyx-train's layout)
        trainer_state.json           step, data position, scheduler, config, metrics and
                                     ``sharded`` = {format: dcp, world_size, strategy, mesh}

Atomic: every rank writes into ``.tmp-step-000100``; after a barrier, rank 0 writes
``trainer_state.json`` last and renames the directory into place (plyx-train's
``CheckpointManager.commit``). A kill at any moment before the rename leaves a hidden
temporary directory that resume never picks up (``CheckpointManager.steps`` lists only
committed ``step-*`` directories holding ``trainer_state.json``).

Resharding: DCP stores each tensor's global shape and the offsets of its shards, and
``dcp.load`` reads whatever pieces the loading ranks' own shards need, so a checkpoint
written at world size 2 loads at 1, 4, or in a single process without a process group
(``consolidate``). No pickle: DCP's metadata is read by DCP itself, RNG states are
safetensors + JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plyx.train import CheckpointManager
from plyx.train._checkpoint import (
    STATE_JSON,
    STATE_TENSORS,
    capture_rng,
    optimizer_from_flat,
    optimizer_to_flat,
)
from safetensors.torch import load_file, save_file

__all__ = ["save_sharded", "finish_pending", "PendingSave", "load_into", "consolidate", "SHARDED_FORMAT", "FAULT_ENV"]

SHARDED_FORMAT = "dcp"
#: fault injection for tests: ``STEP:RANK:MARKER`` makes rank RANK stop inside the save of STEP, write its pid to
#: MARKER and wait there to be killed: after its shards are written and before the commit (synchronous saves),
#: or in the background thread before its shards are written (``dist.async_save``)
FAULT_ENV = "PLYX_DIST_FAULT_IN_SAVE"


def _state_dicts(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _rng_files(root: Path, rank: int) -> tuple[Path, Path]:
    return root / "rng" / f"rank-{rank:05d}.safetensors", root / "rng" / f"rank-{rank:05d}.json"


def _fault(step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    at, who, marker = spec.split(":", 2)
    if int(at) == step and int(who) == rank:
        Path(marker).write_text(str(os.getpid()))
        while True:  # the test SIGKILLs the run here, mid-checkpoint
            time.sleep(0.5)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer; with ``fault`` and ``FAULT_ENV`` set, the chosen rank stops inside its shard writes
    (the async save's background thread), so a test can kill it while the checkpoint is half-written."""

    def __init__(self, path: Path, step: int, rank: int, *, fault: bool) -> None:
        super().__init__(str(path))
        self._step, self._rank, self._fault = step, rank, fault

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._fault:
            _fault(self._step, self._rank)
        return super().write_data(plan, planner)


@attrs.define
class PendingSave:
    """An asynchronous save in flight: DCP's future, and what rank 0 writes once it completes."""

    step: int
    tmp: Path
    final: Path
    future: Any  # concurrent.futures.Future of dcp.async_save
    manager: CheckpointManager
    doc: dict[str, Any] | None  # rank 0: trainer_state.json, captured when the save started


def save_sharded(strategy: Any, manager: CheckpointManager, step: int, module: torch.nn.Module, optimizer: Any,
                 scheduler: Any, *, state: dict[str, Any], card_fields: dict[str, Any], tokenizer_file: Any) -> Path:
    """Write the checkpoint of ``step`` from every rank; rank 0 commits it. Returns its directory.

    With ``dist.async_save`` the shards are staged to CPU memory here and written by DCP's background
    thread, whose collectives run on the strategy's own gloo group (``checkpoint_group``), never
    interleaved with training's; the previous asynchronous save is waited for (and committed) first, and
    this one is committed by ``finish_pending`` once its future completes: ``trainer_state.json`` is
    written and the directory renamed only then, so a kill at any moment before leaves no checkpoint
    that resume picks up.
    """
    finish_pending(strategy, wait=True)  # one save in flight at a time, committed in order
    rank = strategy.rank
    final = manager.path_for(step)
    tmp = manager.root / f".tmp-{final.name}"
    if rank == 0:
        manager.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a leftover of a killed save of this step
        (tmp / "rng").mkdir(parents=True)
    strategy.barrier()
    sd = _state_dicts(module, optimizer)
    rng_json, rng_tensors = capture_rng()
    tensors_path, json_path = _rng_files(tmp, rank)
    save_file(rng_tensors, str(tensors_path))
    json_path.write_text(json.dumps(rng_json) + "\n", encoding="utf-8")
    doc = None
    if rank == 0:  # everything but trainer_state.json, which marks the checkpoint complete and comes last
        if tokenizer_file is not None and Path(tokenizer_file).is_file():
            shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        save_file(rng_tensors, str(tmp / STATE_TENSORS))
        doc = {
            "format": 1,
            **state,
            "step": step,
            "rng": rng_json,
            "optimizer": None,  # in dcp/
            "scheduler": scheduler.state_dict(),
            "card": card_fields,
            "sharded": {"format": SHARDED_FORMAT, "world_size": strategy.world_size, "strategy": strategy.name,
                        "mesh": dict(zip(strategy.plan.mesh_names, strategy.plan.mesh_shape))},
        }
    asynchronous = strategy.checkpoint_group is not None
    writer = _Writer(tmp / "dcp", step, rank, fault=asynchronous)
    if asynchronous:
        # staging (a CPU copy of this rank's shards) happens before async_save returns: training may
        # update the parameters at once; the rng files above were written before DCP's first collective,
        # so rank 0's future completing means every rank's files are on disk
        future = dcp.async_save(sd, storage_writer=writer, process_group=strategy.checkpoint_group)
        strategy.pending_save = PendingSave(step, tmp, final, future, manager, doc)
        return final
    dcp.save(sd, storage_writer=writer)
    _fault(step, rank)
    strategy._collective(lambda: dist.barrier(), "barrier before the checkpoint commit")
    if doc is not None:
        _commit(manager, tmp, step, doc)
    strategy._collective(lambda: dist.barrier(), "barrier after the checkpoint commit")
    return final


def _commit(manager: CheckpointManager, tmp: Path, step: int, doc: dict[str, Any]) -> Path:
    (tmp / STATE_JSON).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")  # written last
    return manager.commit(tmp, step)


def finish_pending(strategy: Any, *, wait: bool) -> list[Path]:
    """Commit the asynchronous save in flight once its DCP future completes (rank 0 renames it into place).

    Args:
        strategy: the ``DistStrategy`` (its ``pending_save``).
        wait: block until the save completes; False returns at once when it is still being written.

    Returns:
        the checkpoints committed by this call (rank 0; other ranks get the same paths, written by rank 0).

    Raises:
        RankFailure: the background write failed (most often a peer died during it); nothing is committed.
    """
    pending = strategy.pending_save
    if pending is None or (not wait and not pending.future.done()):
        return []
    strategy.pending_save = None
    try:
        pending.future.result()
    except Exception as exc:  # noqa: BLE001 - any failure of the background write means: do not commit
        from plyx.dist._strategy import RankFailure

        raise RankFailure(
            f"rank {strategy.rank}: the asynchronous save of step {pending.step} failed "
            f"({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); it was not committed and "
            f"{pending.tmp.name} is never resumed (another rank probably died during the write)"
        ) from None
    if pending.doc is not None:
        _commit(pending.manager, pending.tmp, pending.step, pending.doc)
    strategy.committed.append(pending.final)  # for the Trainer's plyx_on_checkpoint_saved (committed_checkpoints)
    return [pending.final]


def _read_doc(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_JSON).read_text(encoding="utf-8"))


def load_into(strategy: Any, path: Any, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any] | None:
    """Load a sharded (any world size) or plain plyx checkpoint into this rank's shards.

    Returns this rank's RNG state when the checkpoint was written at this world size, else None
    (the Trainer then restores rank 0's).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    doc = _read_doc(path)
    sharded = doc.get("sharded")
    if sharded:
        sd = _state_dicts(module, optimizer)
        dcp.load(sd, checkpoint_id=str(path / "dcp"))
        set_state_dict(module, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        tensors_path, json_path = _rng_files(path, strategy.rank)
        if sharded.get("world_size") == strategy.world_size and tensors_path.is_file():
            return json.loads(json_path.read_text(encoding="utf-8")), load_file(str(tensors_path))
        return None
    # a plain single-process checkpoint: every rank reads the full tensors and keeps its shards
    from plyx.model import open_checkpoint

    # the stored tensors as they are (an adapted model's ``lora_*`` tensors included); set_state_dict checks names
    ckpt = open_checkpoint(path)
    ckpt.verify()
    full = dict(ckpt.load_state_dict("cpu"))
    tensors = load_file(str(path / STATE_TENSORS))
    optim_full = _optimizer_by_name(module, optimizer, optimizer_from_flat(doc["optimizer"], tensors))
    set_state_dict(module, optimizer, model_state_dict=full, optim_state_dict=optim_full,
                   options=StateDictOptions(full_state_dict=True))
    return None


def _optimizer_by_name(module: torch.nn.Module, optimizer: Any, optim: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (states keyed by index) -> the FQN-keyed form ``set_state_dict`` takes.

    Indices count the parameters group by group in the saving optimizer's order, which
    ``build_optimizer`` reproduces: index i is the i-th parameter of this optimizer's groups.
    """
    name_of = {id(p): n for n, p in module.named_parameters()}
    ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in optim["param_groups"] for i in group["params"]]
    if len(saved) != len(ordered):
        from plyx.train import ResumeError

        raise ResumeError(f"the checkpoint's optimizer holds {len(saved)} parameters, this model {len(ordered)}")
    index_to_name = dict(zip(saved, ordered))
    groups = [dict(group, params=[index_to_name[i] for i in group["params"]]) for group in optim["param_groups"]]
    state = {index_to_name[int(k)]: v for k, v in optim["state"].items()}
    return {"state": state, "param_groups": groups}


def consolidate(checkpoint: Any, out: Any) -> Path:
    """A sharded checkpoint as one plain plyx checkpoint directory at ``out`` (single process, no group).

    ``out`` holds the model (plyx-model's safetensors + card, loadable by ``plyx serve``), the
    full optimizer state, the scheduler and the data position, so a single-process
    ``plyx train --resume OUT`` continues the run: its config is the run's with ``batch_size``
    set to the global batch (``batch_size x data ranks``).
    """
    from plyx.model import TransformerLM, save_checkpoint
    from plyx.specs import TrainConfig
    from plyx.train import build_optimizer
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    src = CheckpointManager.resolve(checkpoint)
    doc = _read_doc(src)
    sharded = doc.get("sharded")
    if not sharded:
        raise ValueError(f"{src} is already a plain plyx checkpoint (no `sharded` entry in {STATE_JSON}); "
                         f"use it as it is")
    config = TrainConfig.from_dict(doc["config"])
    model = TransformerLM(config.model, device="meta").to_empty(device="cpu")
    optimizer = build_optimizer(model, config.optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(src / "dcp"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    dp = int(doc["data"].get("world_size", 1))
    data = dict(doc["data"], rank=0, world_size=1, batch_size=int(doc["data"]["batch_size"]) * dp)
    plain = config.to_dict()
    plain["batch_size"] = data["batch_size"]
    plain.pop("dist", None)

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new directory (consolidate never overwrites)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tmp, card_fields=doc.get("card"))
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", tmp / "tokenizer.json")
    rng_tensors = load_file(str(src / STATE_TENSORS))
    optim_json, optim_tensors = optimizer_to_flat(optimizer.state_dict())
    save_file({**optim_tensors, **rng_tensors}, str(tmp / STATE_TENSORS))
    state = {k: v for k, v in doc.items() if k not in ("sharded", "card", "optimizer", "config", "data")}
    state.update({"config": plain, "data": data, "optimizer": optim_json, "consolidated_from": str(src)})
    (tmp / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out
