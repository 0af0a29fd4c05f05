"""No host sync inside the training step (issue 19): nothing between a batch's transfer and the optimizer's
update asks the host for a tensor's value. On CPU the reads are counted at their call sites; on CUDA the
step runs under ``torch.cuda.set_sync_debug_mode("error")`` (``TrainOptions.sync_debug``)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from plyx.specs import Batch
from plyx.train import Trainer, TrainOptions
from plyx.train._transfer import no_sync, to_device

QUIET = {"progress": False, "tensorboard": False}
_READS = ("item", "__bool__", "__float__", "__int__", "tolist", "nonzero")

#: where a run may read values: the previous step's scalars (pinned copies behind an event), a logging step's
#: per-layer norms, the end of the run (its final checkpoint), and the reference kernels' value checks (CPU
#: only: on a GPU the registry picks the Triton kernels, which check no values)
_ALLOWED = ("plyx/train/_step_stats.py", "plyx/train/_metrics.py", "plyx/kernel/reference/",
            "plyx/train/_checkpoint.py")


def _plyx_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost plyx frame of a read (the code that asked), as ``path:line``."""
    for frame in reversed(stack):
        if "/plyx/" in frame.filename.replace("\\", "/"):
            return f"{frame.filename.replace(chr(92), '/').split('/src/')[-1]}:{frame.lineno}"
    return "<outside plyx>"


def test_the_step_reads_no_tensor_value(tiny_config, prepared: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=6, log_every=100, eval_every=0, checkpoint_every=0,
                      sample_tokens=0)
    trainer = Trainer(cfg, options=TrainOptions(async_stats=True, **QUIET))
    sites: list[str] = []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            sites.append(_plyx_site(traceback.extract_stack()[:-1]))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    result = trainer.fit()
    monkeypatch.undo()
    assert len(result.losses) == 6
    unexpected = sorted({s for s in sites if not any(a in s for a in _ALLOWED)})
    assert unexpected == [], f"host reads inside the step at {unexpected}"
    # the check itself sees reads: the previous steps' scalars are read (one list per step)
    assert sum("plyx/train/_step_stats.py" in s for s in sites) == 6


def test_to_device_keeps_the_batch() -> None:
    ids = torch.arange(6).view(2, 3)
    batch = Batch(input_ids=ids, targets=ids + 1, document_ids=torch.zeros_like(ids), meta={"shard": 1})
    moved = to_device(batch, torch.device("cpu"))
    assert torch.equal(moved.input_ids, ids) and torch.equal(moved.targets, ids + 1)
    assert moved.position_ids is None and moved.meta == {"shard": 1}
    with no_sync(torch.device("cpu"), enabled=True):  # nothing to check off CUDA
        pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync debug mode needs a GPU")
def test_cuda_step_has_no_host_sync(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=6, log_every=100, eval_every=0, checkpoint_every=0,
                      sample_tokens=0, device="cuda")
    result = Trainer(cfg, options=TrainOptions(async_stats=True, sync_debug=True, **QUIET)).fit()
    assert len(result.losses) == 6
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_device_pins_and_copies_asynchronously() -> None:
    ids = torch.arange(12).view(3, 4)
    with no_sync(torch.device("cuda"), enabled=True):
        moved = to_device(Batch(input_ids=ids, targets=ids), torch.device("cuda"))
    assert moved.input_ids.is_cuda and torch.equal(moved.input_ids.cpu(), ids)
