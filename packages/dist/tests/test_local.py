"""World size 1: the optimizer step and the clipping on the DTensors' local tensors (``plyx.dist._local``).

On a one-rank mesh a DTensor's local tensor is the whole tensor, so the local path must give the
DTensor path's values bit for bit (same kernels on the same numbers), with the optimizer state kept
as DTensors between steps (what DCP saves). In-process gloo groups of one rank; a few ms each, except
the Trainer comparison (two 4-step runs of the tiny model, ~5 s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

T = None  # the conftest helpers (set by the autouse fixture below)


@pytest.fixture(autouse=True, scope="module")
def _helpers(tools):
    global T
    T = tools


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_model(seed: int, *, shard: bool = True) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    if not shard:
        return model
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    # not elementwise (row and column statistics): right only because the local tensor is the whole matrix
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}
# torch cannot step these on DTensors at all (Adafactor: an in-place pow_ on a _NormPartial norm; fused SGD: no
# sharding strategy for _fused_sgd_), so their reference is the unsharded model; at one rank they now work
NO_DTENSOR_STEP = {"adafactor", "sgd-nesterov"}


def _full(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_local_step_is_the_dtensor_step_bit_for_bit(name):
    from plyx.dist._local import LocalShardStep
    from torch.distributed.tensor import DTensor

    with one_rank():
        ref, got = _sharded_model(0, shard=name not in NO_DTENSOR_STEP), _sharded_model(0)
        opt_ref, opt_got = OPTIMIZERS[name](list(ref.parameters())), OPTIMIZERS[name](list(got.parameters()))
        LocalShardStep(opt_got)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 8, generator=gen)
            for model, opt in ((ref, opt_ref), (got, opt_got)):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        for p_ref, p_got in zip(ref.parameters(), got.parameters(), strict=True):
            assert isinstance(p_got, DTensor)
            assert torch.equal(_full(p_ref), p_got.full_tensor())
            assert p_got._local_tensor.grad is None  # the local view keeps no gradient alive between steps
            s_ref, s_got = opt_ref.state[p_ref], opt_got.state[p_got]
            assert sorted(s_ref) == sorted(s_got)
            for key, v_ref in s_ref.items():
                v_got = s_got[key]
                if name not in NO_DTENSOR_STEP:  # moments stay DTensors (DCP saves and reshards them)
                    assert type(v_got) is type(v_ref), key
                assert torch.equal(torch.as_tensor(_full(v_ref)), torch.as_tensor(_full(v_got))), key
        # the local views share the DTensors' memory: the first step's new moments are the DTensors' own
        p0 = next(got.parameters())
        if "exp_avg" in opt_got.state[p0]:
            local = opt_got.state[p0]["exp_avg"].to_local()
            assert local.data_ptr() == opt_got.state[p0]["exp_avg"]._local_tensor.data_ptr()


def test_local_step_state_checkpoints_through_dcp_state_dicts():
    from plyx.dist._local import LocalShardStep
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    with one_rank():
        model = _sharded_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        LocalShardStep(opt)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        sd = get_optimizer_state_dict(model, opt)
        moments = [v for s in sd["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
        assert moments and all(isinstance(v, DTensor) for v in moments)
        fresh_model = _sharded_model(0)
        fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.05, fused=True)
        LocalShardStep(fresh)
        set_optimizer_state_dict(fresh_model, fresh, sd)
        for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
            assert torch.equal(opt.state[p]["exp_avg_sq"].full_tensor(), fresh.state[q]["exp_avg_sq"].full_tensor())


@pytest.mark.parametrize("max_norm", [0.05, 1e9, float("inf")])
def test_clip_local_is_clip_grad_norm(max_norm):
    from plyx.dist._local import clip_local_

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 3, generator=gen), torch.randn(5, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(params, max_norm)
    got_grads = [g.clone() for g in grads]
    got = clip_local_(got_grads, max_norm)
    assert torch.equal(got, want)
    for p, g in zip(params, got_grads, strict=True):
        assert torch.equal(p.grad, g)


def test_whole_local_refuses_nothing_at_one_rank_and_passes_plain_tensors():
    from plyx.dist._local import whole_local

    plain = torch.ones(2)
    assert whole_local(plain) is plain
    with one_rank():
        w = next(_sharded_model(0).parameters())
        assert whole_local(w).shape == w.shape and whole_local(w).data_ptr() == w.to_local().data_ptr()


def _one_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(T.free_port())}.items():
        monkeypatch.setenv(key, value)


def test_metric_reductions_at_one_rank_run_no_collective(prepared, tmp_path, monkeypatch):
    from plyx.dist import DistStrategy

    _one_rank_env(monkeypatch)
    strategy = DistStrategy(T.tiny_config(prepared, tmp_path, batch_size=2, dist={"strategy": "fsdp"}),
                            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    try:
        def no(*args, **kwargs):
            raise AssertionError("a collective ran at world size 1")

        for name in ("all_reduce", "all_gather", "barrier"):
            monkeypatch.setattr(dist, name, no)
        assert strategy.reduce_mean([1.5, 0.0]) == [1.5, 0.0]
        assert strategy.gather(2.0) == [2.0]
        strategy.barrier()
    finally:
        monkeypatch.undo()
        strategy.close()


def _fit(prepared, out, monkeypatch, local: bool):
    from plyx.train import Trainer, TrainOptions

    _one_rank_env(monkeypatch)
    monkeypatch.setenv("PLYX_DIST_LOCAL_WS1", "1" if local else "0")
    config = T.tiny_config(prepared, out, batch_size=4, dist={"strategy": "fsdp"}, steps=4, checkpoint_every=0)
    trainer = Trainer(config, options=TrainOptions(progress=False, tensorboard=False, handle_signals=False,
                                                   async_stats=True))
    try:
        result = trainer.fit()
        weights = {n: p.full_tensor().clone() for n, p in trainer.module.named_parameters()}
        return trainer, result, weights
    finally:
        trainer.strategy.close()


def test_fsdp_one_rank_trainer_local_path_equals_the_dtensor_path(prepared, tmp_path, monkeypatch):
    """The Trainer at world size 1 (FSDP2): the optimizer and the clip on local tensors give the DTensor
    path's losses, gradient norms and weights bit for bit; plyx-train used the strategy's hooks."""
    from torch.distributed.tensor import DTensor

    t_ref, ref, w_ref = _fit(prepared, tmp_path / "dtensor", monkeypatch, local=False)
    t_got, got, w_got = _fit(prepared, tmp_path / "local", monkeypatch, local=True)
    assert t_ref.strategy._local_step is None and t_got.strategy._local_step is not None
    assert got.losses == ref.losses
    assert got.metrics["grad_norm"] == ref.metrics["grad_norm"]
    for name, w in w_ref.items():
        assert torch.equal(w, w_got[name]), name
    state = next(iter(t_got.optimizer.state.values()))
    assert isinstance(state["exp_avg"], DTensor)


def test_a_step_that_raised_leaves_the_next_step_on_the_dtensors_state():
    """A step that fails inside torch (after the pre-hook swapped in the local views) must not leave the
    optimizer holding local tensors: the next step puts the DTensors back before swapping again."""
    from plyx.dist._local import LocalShardStep
    from torch.distributed.tensor import DTensor

    with one_rank():
        model = _sharded_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        step = LocalShardStep(opt)
        model(torch.randn(3, 8)).sum().backward()
        step._pre(opt, (), {})  # what a step does before it raises
        opt.step()
        assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
        assert all(isinstance(s["exp_avg"], DTensor) for s in opt.state.values()) and len(opt.state) == 4


def test_reloaded_state_is_the_state_the_next_local_step_uses():
    """The local views of the state are reused from step to step; a state loaded into the optimizer (a resume:
    new dicts, new tensors) must replace them. Same sequence on the DTensor path as the reference."""
    from plyx.dist._local import LocalShardStep
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    with one_rank():
        runs = []
        for local in (False, True):
            model = _sharded_model(0)
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
            if local:
                LocalShardStep(opt)
            gen = torch.Generator().manual_seed(2)

            def step(model=model, opt=opt, gen=gen):
                model(torch.randn(4, 8, generator=gen)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()
            saved = {k: v for k, v in get_optimizer_state_dict(model, opt).items()}
            saved["state"] = {n: {k: v.clone() for k, v in s.items()} for n, s in saved["state"].items()}
            step()
            set_optimizer_state_dict(model, opt, saved)  # back to the moments after the first step
            step()
            runs.append([p.full_tensor() for p in model.parameters()])
        for want, got in zip(*runs, strict=True):
            assert torch.equal(want, got)


def test_one_rank_reduce_dtype_float32_gives_the_bf16_reduction_bit_for_bit():
    """At one rank nothing is summed: reducing bf16 gradients in float32 (the cast inside FSDP2's copy-in, one
    kernel fewer per block) gives the float32 gradients that reducing in bf16 and casting after gives; and
    ``apply_fsdp`` (``reshard_after_forward=False``, as ``DistStrategy`` asks at one rank) keeps the unsharded
    bf16 parameters from the forward to the backward (no second copy-in)."""
    from plyx.dist._parallelize import apply_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    class Blocks(torch.nn.Module):  # apply_fsdp shards model.layers one by one, then the root
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](torch.nn.functional.gelu(self.layers[0](x)))

    grads, unsharded_after_forward = {}, {}
    with one_rank():
        mesh = init_device_mesh("cpu", (1,))
        for reduce_dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = Blocks()
            apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                       reshard_after_forward=False, shard_head=False)
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
            out = model(x)
            groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.layers, model)]
            unsharded_after_forward[reduce_dtype] = [g.is_unsharded for g in groups if g is not None]
            out.float().square().mean().backward()
            grads[reduce_dtype] = [p.grad.to_local().clone() for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads[torch.float32])
    assert all(torch.equal(a, b) for a, b in zip(grads[torch.float32], grads[torch.bfloat16], strict=True))
    assert all(unsharded_after_forward[torch.float32])


def test_gradient_sync_flag_is_set_only_when_it_changes(prepared, tmp_path, monkeypatch):
    """``micro_batch`` tells FSDP2 whether to reduce only when the answer changes (setting it walks every
    module): once for a run without accumulation, at every micro-batch with it, again for another model."""
    from plyx.dist import DistStrategy

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def set_requires_gradient_sync(self, flag: bool) -> None:
            self.calls.append(flag)

    _one_rank_env(monkeypatch)
    strategy = DistStrategy(T.tiny_config(prepared, tmp_path, batch_size=2, dist={"strategy": "fsdp"}),
                            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    try:
        model, other = Recorder(), Recorder()
        for last in (True, True, True):  # three steps, one micro-batch each
            with strategy.micro_batch(model, last=last):
                pass
        assert model.calls == [True]
        for last in (False, True, False, True):  # two steps of two micro-batches
            with strategy.micro_batch(model, last=last):
                pass
        assert model.calls == [True, False, True, False, True]
        with strategy.micro_batch(other, last=True):
            pass
        assert other.calls == [True]
    finally:
        strategy.close()


def test_fsdp_one_rank_accumulation_matches_the_plain_trainer(prepared, tmp_path, monkeypatch):
    """FSDP2 at one rank with 2 micro-batches a step (the first without gradient sync, the second with it)
    against the plain single-device Trainer on the same config: the same losses (float32; 1e-5 for the
    order of FSDP's accumulation in its reduce dtype against autograd's)."""
    from plyx.train import Trainer, TrainOptions

    losses = {}
    for name in ("plain", "fsdp"):
        if name == "fsdp":
            _one_rank_env(monkeypatch)
        config = T.tiny_config(prepared, tmp_path / name, batch_size=2, grad_accum=2, steps=3, checkpoint_every=0,
                               dist={"strategy": "fsdp"} if name == "fsdp" else None)
        trainer = Trainer(config, options=TrainOptions(progress=False, tensorboard=False, handle_signals=False))
        try:
            losses[name] = trainer.fit().losses
        finally:
            if trainer.strategy is not None and hasattr(trainer.strategy, "close"):
                trainer.strategy.close()
    assert len(losses["fsdp"]) == 3
    assert losses["fsdp"] == pytest.approx(losses["plain"], rel=1e-5)
