"""``TrainConfig.attention`` / ``compiled_norms``: the compiled step traces SDPA and RMSNorm as torch ops (no
``plyx::`` custom op for them, so no recompute) with eager's loss and gradients; bad choices fail before any step
with the fix; the run logs what it chose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plyx.kernel import training_kernels
from plyx.specs import Batch, ConfigError
from plyx.train import Trainer, TrainOptions, lm_loss


def _model_and_batch(docs: bool) -> tuple[torch.nn.Module, Batch]:
    from plyx.model import TransformerLM
    from plyx.specs.config.model import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    module = TransformerLM(config)
    ids = torch.randint(0, 64, (2, 16))
    document_ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16]) if docs else None
    return module, Batch(input_ids=ids, targets=torch.roll(ids, -1, 1), document_ids=document_ids)


def _step(model: torch.nn.Module, module: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = lm_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("norms", ["inductor", "kernel"])
def test_compiled_step_traces_the_chosen_ops_with_eagers_gradients(norms: str, docs: bool) -> None:
    """The whole model and loss compiled (aot_eager: the ATen graphs are recorded) in one graph: attention is aten
    SDPA (packed documents too: CPU has no Triton kernel), RMSNorm torch ops (``inductor``) or the
    ``plyx::rmsnorm*`` ops (``kernel``); loss and every gradient equal eager's (float32: accumulation order)."""
    from torch._dynamo.backends.common import aot_autograd

    module, batch = _model_and_batch(docs)
    want, want_grads = _step(module, module, batch)
    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, example: object) -> object:
        from functorch.compile import make_boxed_func

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        seen.append("graph")
        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example)

    torch._dynamo.reset()
    with training_kernels("auto", norms, device="cpu"):
        got, got_grads = _step(torch.compile(module, backend=backend), module, batch)
    assert seen.count("graph") == 1, "a graph break in the compiled forward"
    ops = {t for t in seen if t.startswith("plyx.")}
    assert not {t for t in ops if "attention" in t}, ops
    assert any("scaled_dot_product" in t for t in seen)
    norm_ops = {t for t in ops if "rmsnorm" in t}
    if norms == "inductor":
        assert not norm_ops, norm_ops
    else:
        assert {"plyx.rmsnorm.default", "plyx.rmsnorm_residual_backward.default"} <= norm_ops, norm_ops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_bad_choices_fail_before_any_step(tiny_config, prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"compiled_norms.*set compile = true"):
        tiny_config(prepared, tmp_path / "a", compiled_norms="kernel")
    with pytest.raises(ConfigError, match=r"Triton flash kernel runs on CUDA in bf16 only.*attention = \"auto\""):
        tiny_config(prepared, tmp_path / "b", attention="triton")
    with pytest.raises(ConfigError, match=r"Invalid enum value 'flash' - at `\$\.attention`"):
        tiny_config(prepared, tmp_path / "c", attention="flash")
    # "auto" device resolving to the CPU: refused by the Trainer, with the rule's message
    cfg = tiny_config(prepared, tmp_path / "d", attention="triton", device="auto", precision="bf16-autocast")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"attention = 'triton' needs a CUDA GPU"):
            Trainer(cfg, options=TrainOptions(progress=False, tensorboard=False))


def test_the_run_logs_its_kernel_choice(tiny_config, prepared: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    cfg = tiny_config(prepared, tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0, sample_tokens=0,
                      attention="sdpa")
    Trainer(cfg, options=TrainOptions(progress=False, tensorboard=False, print_fn=lines.append)).fit()
    assert lines[0] == "kernels: attention = torch SDPA for every call (sdpa: cpu has no Triton kernel)", lines[:2]
    assert "compiled:" not in lines[0]  # compile is off: nothing about the compiled graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hybrid attention's Triton side needs CUDA")
@pytest.mark.parametrize("docs", [False, True])
def test_compiled_step_on_cuda_sdpa_unpacked_triton_packed(docs: bool) -> None:
    """On a GPU under bf16 autocast with ``attention = "sdpa"``: unpacked batches trace aten SDPA, packed documents
    the ``plyx::attention`` op (the Triton kernel, its saved lse: one forward per forward+backward); eager's loss and
    gradients within bf16 tolerance."""
    from plyx.kernel._saving import FORWARD_RUNS
    from plyx.model import TransformerLM
    from plyx.specs.config.model import ModelConfig
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=96, max_seq_len=32)
    module = TransformerLM(config, device="cuda")
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    document_ids = torch.tensor([[0] * 12 + [1] * 20, [0] * 32], device="cuda") if docs else None
    batch = Batch(input_ids=ids, targets=torch.roll(ids, -1, 1), document_ids=document_ids)
    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, example: object) -> object:
        from functorch.compile import make_boxed_func

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    with training_kernels("sdpa", "auto", device="cuda", dtype=torch.bfloat16):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, want_grads = _step(module, module, batch)
        torch._dynamo.reset()
        runs = FORWARD_RUNS["attention"]
        compiled = torch.compile(module, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, got_grads = _step(compiled, module, batch)
    has_op = "plyx.attention.default" in seen
    assert has_op == docs, sorted(set(seen))
    assert any("scaled_dot_product" in t for t in seen) != docs
    assert FORWARD_RUNS["attention"] - runs == (1 if docs else 0)  # one layer: no recompute in the backward
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for name, g in want_grads.items():
        assert (got_grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-6) < 5e-2, name
