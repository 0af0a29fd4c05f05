"""``compile = true``: the Trainer's model under ``torch.compile`` (Inductor) through plyx's kernels as custom ops
(plyx-kernel >= 1.3) trains to the same losses as eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plyx.train import Trainer, TrainOptions

QUIET = {"progress": False, "tensorboard": False}


def test_compile_true_trains_like_eager(tiny_config, prepared: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # hermetic: Inductor's C++ cache
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = tiny_config(prepared, tmp_path / f"run-{compiled}", steps=3, eval_every=0, checkpoint_every=0,
                          sample_tokens=0, compile=compiled, data={"mode": "packed"})
        runs[compiled] = Trainer(cfg, options=TrainOptions(**QUIET)).fit().losses
    assert len(runs[True]) == 3
    # Inductor fuses and reorders float32 arithmetic: equal up to accumulation order, over three updates
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
    assert runs[True][-1] < runs[True][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: the Triton kernels in Triton's interpreter "
                    "(on CUDA plyx-model's test_compile runs them compiled)")
def test_compiled_training_step_never_traces_a_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """mfu.py's compiled step (``torch.compile(model)``, ``lm_loss``, backward, bf16 autocast) with the registry
    forced to the Triton implementations (interpreted on CPU): every kernel the forward and backward reach
    is a ``plyx::`` custom op, in one graph, and no Triton launch is ever wrapped by Dynamo
    (``triton_kernel_wrapper_mutation``: the H100 run's crash). Same loss and gradients as eager."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (conftest turns it on before triton is imported)")
    import plyx.kernel._default as default
    from plyx.kernel._registry import Registry
    from plyx.kernel.attention import attention_triton
    from plyx.kernel.triton_ops._registration import _lazy
    from plyx.model import TransformerLM
    from plyx.specs import Batch
    from plyx.specs.config.model import ModelConfig
    from plyx.specs.kernels import Capability, KernelImpl
    from plyx.train import lm_loss

    reg = default.populate(Registry())
    for name in ("rmsnorm", "swiglu", "rope", "rope_qk", "cross_entropy", "linear_cross_entropy"):
        reg.register(KernelImpl(name, "triton-anywhere", _lazy(name, name), capability=Capability(), priority=100))
    reg.register(KernelImpl("attention", "triton-anywhere", attention_triton,
                            capability=Capability(dtypes={"bfloat16"}, shape_in={"head_dim": {64}}), priority=100))
    monkeypatch.setattr(default, "_DEFAULT", reg)

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=48, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=96, max_seq_len=8)
    module = TransformerLM(config)
    ids = torch.randint(0, 48, (1, 8))
    batch = Batch(input_ids=ids, targets=torch.roll(ids, -1, 1))
    chosen = {n: reg.select(n, q).impl for n, q in (("rmsnorm", _query("rmsnorm", "float32")),
                                                     ("attention", _query("attention", "bfloat16", head_dim=64)))}
    assert chosen == {"rmsnorm": "triton-anywhere", "attention": "triton-anywhere"}, chosen

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        return loss.detach(), grads

    want, want_grads = step(module)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        seen.append("graph")
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_record(seen), bw_compiler=_record(seen))(gm, example)

    torch._dynamo.reset()
    got, got_grads = step(torch.compile(module, backend=backend))
    assert seen.count("graph") == 1, "a graph break in the compiled forward"
    assert not [t for t in seen if "triton_kernel_wrapper" in t], sorted(set(seen))
    for op in ("rmsnorm", "rmsnorm_residual", "rope_qk", "attention", "swiglu"):
        assert f"plyx.{op}.default" in seen and f"plyx.{op}_backward.default" in seen, (op, sorted(set(seen)))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for name, g in want_grads.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert (got_grads[name] - g).abs().max() / scale < 3e-2, name


def _query(name: str, dtype: str, **shape: int) -> object:
    from plyx.specs.kernels import KernelQuery

    return KernelQuery(device_type="cpu", dtype=dtype, shape=shape or {"hidden": 128}, requires_grad=True)


def _record(seen: list[str]) -> object:
    """An AOT compiler that records the ATen-level graph's call targets (forward and backward) and runs it."""

    def compiler(gm: torch.fx.GraphModule, example: object) -> object:
        from functorch.compile import make_boxed_func

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    return compiler
