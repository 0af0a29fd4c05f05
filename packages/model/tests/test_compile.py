"""``torch.compile`` of a ``TransformerLM`` through the kernel registry's custom ops (plyx-kernel >= 1.3).

One graph (``fullgraph=True``: a graph break raises), equal to eager in the loss and every gradient. On CPU
the ops run the registry's reference implementations; the custom-op layer itself is tested op by op
(opcheck, fake shapes, autograd) in plyx-kernel's ``test_custom_ops.py``.
"""

from __future__ import annotations

import plyx.kernel as K
import pytest
import torch
from plyx.model import TransformerLM
from plyx.specs.config.model import ModelConfig


def _loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
    hidden = model(ids, document_ids=docs, return_hidden=True)  # (B, T, D)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B T, D)
    return K.linear_cross_entropy(flat, model.lm_head_weight, targets.reshape(-1))


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed-documents"])
def test_compiled_forward_backward_equals_eager(packed: bool) -> None:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = TransformerLM(config)
    ids = torch.randint(0, 61, (2, 12))
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12]) if packed else None
    want = _loss(model, ids, targets, docs)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(_loss)(model, ids, targets, docs)
    assert explain.graph_break_count == 0, explain.break_reasons
    ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"plyx.rmsnorm.default", "plyx.rope_qk.default", "plyx.attention.default", "plyx.swiglu.default",
            "plyx.linear_cross_entropy.default"} <= ops, sorted(o for o in ops if "plyx" in o)

    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    got = compiled(model, ids, targets, docs)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels inside the custom ops")
def test_compiled_on_cuda_through_triton_kernels_equals_eager() -> None:
    """Inductor with the registry's Triton kernels (flash attention included) as opaque ops, bf16."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=256)
    model = TransformerLM(config, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    targets = torch.roll(ids, -1, 1)
    want = _loss(model, ids, targets, None)
    want.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    got = torch.compile(_loss, fullgraph=True)(model, ids, targets, None)
    got.backward()
    # bf16: Inductor fuses the glue between kernels in another order; 2% of each gradient's scale
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for name, p in model.named_parameters():
        scale = grads[name].abs().max().clamp(min=1e-6)
        assert (p.grad.float() - grads[name]).abs().max() / scale < 2e-2, name
