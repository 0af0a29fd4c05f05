"""Multi-process training on gloo (2 and 4 CPU ranks) against single-process references.

What is checked, and against what:

- DDP (2 ranks, 2 micro-batches each: ``no_sync`` accumulation; every other block recomputed),
  FSDP2 (2 ranks, meta-device init) and FSDP + TP (2 ranks on a 1 x 2 mesh, every block
  recomputed) give the loss of every step of a single
  process at the same global batch (the data slices are disjoint and their union is the
  single process's batch).
- DCP: the FSDP checkpoint of step 4 written by 2 ranks loads in 1 process (parameters
  identical to the consolidated checkpoint, bit for bit) and in 4 ranks as FSDP + TP on a
  2 x 2 mesh, and both continue with the single process's losses.
- SIGKILL of rank 1 inside the save of step 4: ``plyx train`` exits naming rank 1, the
  half-written checkpoint is never resumed, and the resumed run ends with weights equal to an
  uninterrupted run's, bit for bit.

Tolerance of the loss comparisons (float32): relative 2e-5. The distributed runs add the
same numbers in other orders: per-rank means averaged by an all-reduce instead of one mean,
gradients summed by all-reduce / reduce-scatter, the gradient norm summed over shards, and
under TP the matmuls' partial sums over 2 ranks. Each is a float32 rounding difference of a
few ulps (~1e-7 relative); six AdamW steps at lr 3e-3 carry them to at most ~1e-6 here
(measured), so 2e-5 holds with margin while a wrong slice, a missing all-reduce or a
double-counted micro-batch moves the loss by more than 1e-3 from the first step on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REL = 2e-5
T = None  # the conftest helpers (set by the autouse fixture below)


@pytest.fixture(autouse=True, scope="module")
def _helpers(tools):
    global T
    T = tools


def _single(prepared: Path, out: Path, **kw: int):
    from plyx.train import Trainer, TrainOptions

    config = T.tiny_config(prepared, out, **kw)
    result = Trainer(config, options=TrainOptions(progress=False, tensorboard=False)).fit()
    return result, T.losses(out)


def _close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=REL), f"step {step}: {got[step]} vs {want[step]}"


@pytest.fixture(scope="module")
def reference_run(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, batch 4: plain checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("single") / "run"
    _single(prepared, out, batch_size=4)
    return out


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> dict[int, float]:
    """The losses every 4-row global batch run must reproduce."""
    return T.losses(reference_run)


@pytest.fixture(scope="module")
def fsdp_run(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 on 2 ranks (batch 2 each), through ``plyx train CONFIG --nproc 2``; checkpoints at 2, 4, 6."""
    out = tmp_path_factory.mktemp("fsdp")
    config = T.write_config(T.tiny_config(prepared, out / "run", batch_size=2, dist={"strategy": "fsdp"}),
                          out / "config.json")
    T.plyx_train(config, nproc=2)
    return out / "run"


def test_ddp_with_accumulation_matches_one_process(prepared, tmp_path):
    want = _single(prepared, tmp_path / "single", batch_size=2, grad_accum=2)[1]
    config = T.write_config(T.tiny_config(prepared, tmp_path / "run", batch_size=1, grad_accum=2,
                                      dist={"strategy": "ddp", "activation_checkpointing": "every_2nd"}),
                            tmp_path / "config.json")
    proc = T.plyx_train(config, nproc=2, torchrun=True)  # torchrun ... -m plyx.specs train CONFIG
    _close(T.losses(tmp_path / "run"), want, range(1, 7))
    assert proc.stdout.count("plyx train:") == 1  # only rank 0 prints
    row = T.metric_rows(tmp_path / "run")[-1]
    assert float(row["tokens_per_s/rank0"]) > 0 and float(row["tokens_per_s/rank1"]) > 0
    assert float(row["peak_mem_mb/rank1"]) > 0
    assert 0.0 < float(row["allreduce_share"]) < 1.0


def _comm_shares(run: Path) -> list[float]:
    """``allreduce_share`` of every logged row: FSDP's all-gathers and reduce-scatters (and TP's all-reduces),
    measured on a profiled step (gloo's collective spans), as a fraction of that step's wall time."""
    shares = [float(r["allreduce_share"]) for r in T.metric_rows(run) if r.get("tokens_per_s")]
    assert shares and all(0.0 < share < 1.0 for share in shares), shares
    return shares


def test_fsdp_matches_one_process(fsdp_run, reference):
    _close(T.losses(fsdp_run), reference, range(1, 7))
    assert (fsdp_run / "checkpoints" / "step-000006" / "dcp" / ".metadata").is_file()
    assert len(_comm_shares(fsdp_run)) == 6  # log_every = 1: every window has its sampled step


def test_fsdp_tp_matches_one_process(prepared, tmp_path, reference):
    config = T.write_config(T.tiny_config(prepared, tmp_path / "run", batch_size=4,
                                      dist={"strategy": "fsdp+tp", "tp_size": 2, "activation_checkpointing": "full"}),
                            tmp_path / "config.json")
    proc = T.plyx_train(config, nproc=2)  # mesh (dp 1, tp 2): both ranks read the same 4 rows; every block recomputed
    _close(T.losses(tmp_path / "run"), reference, range(1, 7))
    shares = _comm_shares(tmp_path / "run")
    assert f"comm {shares[-1] * 100:.0f}%" in proc.stdout  # the log line shows it too


def test_consolidate_gives_the_single_process_weights(fsdp_run, prepared, tmp_path):
    from plyx.dist import consolidate
    from plyx.model import load_checkpoint

    result, _ = _single(prepared, tmp_path / "single", batch_size=4)
    out = consolidate(fsdp_run, tmp_path / "plain")
    got, want = load_checkpoint(out).state_dict(), load_checkpoint(result.checkpoint).state_dict()
    assert got.keys() == want.keys()
    for name in want:  # weights are O(0.02-1); six Adam steps of rounding differences stay below 1e-5
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    with pytest.raises(FileExistsError):
        consolidate(fsdp_run, out)


@pytest.mark.parametrize(("source", "strategy"), [("sharded", "fsdp"), ("plain", "fsdp"), ("sharded", "hsdp")])
def test_dcp_reshards_to_one_process(source, strategy, fsdp_run, reference_run, prepared, tmp_path, monkeypatch, reference):
    """2 -> 1: loaded in this process (gloo, world 1): identical parameters, then the same losses.

    ``plain``: a single-process plyx-train checkpoint loads into the FSDP shards the same way;
    ``hsdp``: the FSDP checkpoint loads into HSDP (``fully_shard`` on a 2-D replicate x shard mesh).
    """
    from plyx.dist import consolidate
    from plyx.model import load_checkpoint
    from plyx.train import Trainer, TrainOptions

    if source == "sharded":
        ckpt = fsdp_run / "checkpoints" / "step-000004"
        plain = load_checkpoint(consolidate(ckpt, tmp_path / "plain4")).state_dict()
    else:
        ckpt = reference_run / "checkpoints" / "step-000004"
        plain = load_checkpoint(ckpt).state_dict()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(T.free_port())}.items():
        monkeypatch.setenv(key, value)
    config = T.tiny_config(prepared, tmp_path / "run", batch_size=4, dist={"strategy": strategy})
    trainer = Trainer(config, options=TrainOptions(resume=str(ckpt), progress=False, tensorboard=False,
                                                   handle_signals=False))
    try:
        assert trainer.strategy.name == strategy and trainer.step == 4
        for name, p in trainer.module.named_parameters():
            assert torch.equal(p.full_tensor().detach(), plain[name]), name
        result = trainer.fit()
    finally:
        trainer.strategy.close()
    assert result.losses == pytest.approx([reference[5], reference[6]], rel=REL)


def test_dcp_reshards_to_four_ranks_with_tensor_parallelism(fsdp_run, prepared, tmp_path, reference):
    """2 -> 4: the FSDP checkpoint continues as FSDP + TP on a 2 x 2 mesh (batch 2 per data rank)."""
    config = T.write_config(T.tiny_config(prepared, tmp_path / "run", batch_size=2,
                                      dist={"strategy": "fsdp+tp", "tp_size": 2}), tmp_path / "config.json")
    T.plyx_train(config, "--resume", str(fsdp_run / "checkpoints" / "step-000004"), nproc=4)
    _close(T.losses(tmp_path / "run"), reference, range(5, 7))


def test_sigkill_during_a_checkpoint_write_then_resume_is_bit_exact(fsdp_run, prepared, tmp_path):
    from plyx.dist import consolidate
    from plyx.dist._checkpoint import FAULT_ENV
    from plyx.model import load_checkpoint

    run = tmp_path / "run"
    config = T.write_config(T.tiny_config(prepared, run, batch_size=2, dist={"strategy": "fsdp", "timeout_s": 60}),
                          tmp_path / "config.json")
    marker = tmp_path / "rank1.pid"
    cmd = [sys.executable, "-m", "plyx.specs", "train", str(config), "--nproc", "2", "--no-progress",
           "--no-tensorboard"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=T.worker_env(**{FAULT_ENV: f"4:1:{marker}"}))
    deadline = time.monotonic() + 180
    while not marker.is_file() or not marker.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 1 dies with its shards of step 4 written
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "rank 1 failed (signal SIGKILL" in err, err[-3000:]
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-000002"], steps  # step 4 was never committed

    T.plyx_train(config, "--resume", nproc=2)  # resume picks step 2, not the half-written step 4
    assert T.losses(run).keys() == set(range(1, 7))
    got = load_checkpoint(consolidate(run, tmp_path / "resumed")).state_dict()
    want = load_checkpoint(consolidate(fsdp_run, tmp_path / "uninterrupted")).state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_async_save_killed_mid_write_is_never_resumed_and_resume_is_bit_exact(fsdp_run, prepared, tmp_path):
    """``dist.async_save``: DCP writes in a background thread on its own gloo group.

    Rank 1 stops inside its background write of step 4 (its shards not yet on disk) and is
    SIGKILLed while training goes on in the foreground: step 4 is never committed (rank 0's
    future fails, so no ``trainer_state.json``, no rename), the asynchronously written step 2 is
    what ``--resume`` picks, and the resumed run (asynchronous saves again) ends with the weights
    of the uninterrupted synchronous run, bit for bit: the checkpoints load and continue exactly.
    """
    from plyx.dist import consolidate
    from plyx.dist._checkpoint import FAULT_ENV
    from plyx.model import load_checkpoint

    run = tmp_path / "run"
    config = T.write_config(T.tiny_config(prepared, run, batch_size=2,
                                          dist={"strategy": "fsdp", "async_save": True, "timeout_s": 60}),
                            tmp_path / "config.json")
    marker = tmp_path / "rank1.pid"
    cmd = [sys.executable, "-m", "plyx.specs", "train", str(config), "--nproc", "2", "--no-progress",
           "--no-tensorboard"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=T.worker_env(**{FAULT_ENV: f"4:1:{marker}"}))
    deadline = time.monotonic() + 180
    while not marker.is_file() or not marker.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # mid-write: the background thread holds step 4
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    assert "rank 1 failed (signal SIGKILL" in err, err[-3000:]
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-000002"], steps  # written asynchronously and committed; step 4 never was
    assert not (run / "checkpoints" / ".tmp-step-000004" / "trainer_state.json").exists()

    T.plyx_train(config, "--resume", nproc=2)
    assert T.losses(run).keys() == set(range(1, 7))
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert steps == ["step-000002", "step-000004", "step-000006"], steps  # the last one waited for at the end
    got = load_checkpoint(consolidate(run, tmp_path / "resumed")).state_dict()
    want = load_checkpoint(consolidate(fsdp_run, tmp_path / "uninterrupted")).state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fsdp_on_one_rank_runs_without_a_host_sync_per_step(prepared, tmp_path, monkeypatch, reference):
    """World size 1 (FSDP2 on one GPU): nothing to agree on with other ranks, so the Trainer takes its
    single-device step (loss and gradient norm read a step late, a non-finite update skipped on the device by
    the fused optimizer) instead of the strategy's synchronising one; the losses are the single process's.
    ``async_stats=True`` asks for it on CPU, where it is otherwise used on CUDA only."""
    from plyx.dist import DistStrategy
    from plyx.train import Trainer, TrainOptions
    from torch.distributed.tensor import DTensor

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(T.free_port())}.items():
        monkeypatch.setenv(key, value)

    def synchronising(*args, **kwargs):
        raise AssertionError("the strategy's synchronising clip_grad_norm was called at world size 1")

    monkeypatch.setattr(DistStrategy, "clip_grad_norm", synchronising)
    config = T.tiny_config(prepared, tmp_path / "run", batch_size=4, dist={"strategy": "fsdp"}, checkpoint_every=0)
    trainer = Trainer(config, options=TrainOptions(progress=False, tensorboard=False, handle_signals=False,
                                                   async_stats=True))
    try:
        module = trainer.module
        assert all(isinstance(p, DTensor) for p in module.parameters())  # sharded, on one rank
        assert all(group.get("fused") for group in trainer.optimizer.param_groups)
        with torch.no_grad():  # a one-rank mesh keeps every block gathered after its forward (no reshard)
            module(trainer.train_data.batch(0).input_ids, return_hidden=True)
        assert not isinstance(module.layers[0].self_attn.q_proj.weight, DTensor)
        for sub in module.modules():  # back to the sharded parameters the optimizer holds
            if hasattr(sub, "reshard"):
                sub.reshard()
        assert isinstance(module.layers[0].self_attn.q_proj.weight, DTensor)
        result = trainer.fit()
    finally:
        trainer.strategy.close()
    assert result.losses == pytest.approx([reference[s] for s in range(1, 7)], rel=REL)


def test_a_non_finite_step_is_skipped_on_the_device_with_sharded_parameters():
    """The one-rank step's guard: torch's fused AdamW honours ``found_inf`` (set by plyx-train's
    ``skip_update``) on DTensor parameters too, so a NaN step leaves FSDP's shards untouched."""
    import torch.distributed as dist
    from plyx.train._step_stats import skip_update
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        layer = torch.nn.Linear(8, 8)
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
        for loss in (float("nan"), 1.0):
            layer(torch.randn(2, 8)).sum().backward()
            before = [p.full_tensor().clone() for p in layer.parameters()]
            assert skip_update(optimizer, torch.tensor(loss), torch.tensor(1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            same = all(torch.equal(b, p.full_tensor()) for b, p in zip(before, layer.parameters()))
            assert same == (loss != loss), loss  # skipped exactly when the loss is NaN
    finally:
        dist.destroy_process_group()
