from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.model import TransformerLM
from plyx.specs import Batch, ModelConfig
from plyx.train import generate_ids, lm_loss


def _model(**kw: object) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32, **kw))


def test_lm_loss_equals_cross_entropy_of_full_logits_with_masked_targets() -> None:
    model = _model()
    x = torch.randint(0, 97, (3, 11))
    y = torch.randint(0, 97, (3, 11))
    y[0, :4] = -100  # positions without a loss
    y[2, -1] = -100
    loss = lm_loss(model, Batch(input_ids=x, targets=y))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = F.cross_entropy(model(x.clone()).double().view(-1, 97), y.view(-1), ignore_index=-100)
    ref.backward()
    assert torch.allclose(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_packed_documents_do_not_see_each_other() -> None:
    model = _model()
    doc_a, doc_b, other_a = torch.randint(0, 97, (5,)), torch.randint(0, 97, (6,)), torch.randint(0, 97, (5,))
    ids1 = torch.cat([doc_a, doc_b])[None]
    ids2 = torch.cat([other_a, doc_b])[None]
    docs = torch.tensor([[0] * 5 + [1] * 6])
    y = torch.full((1, 11), -100)
    y[0, 5:] = torch.randint(0, 97, (6,))  # only document b carries a loss
    l1 = lm_loss(model, Batch(input_ids=ids1, targets=y, document_ids=docs))
    l2 = lm_loss(model, Batch(input_ids=ids2, targets=y, document_ids=docs))
    assert torch.allclose(l1, l2, atol=1e-6)  # what precedes document b in the row does not matter


def test_generation_is_greedy_or_seeded() -> None:
    model = _model()
    greedy = generate_ids(model, [1, 2, 3], 6, temperature=0)
    assert greedy[:3] == [1, 2, 3] and len(greedy) == 9
    assert generate_ids(model, [1, 2, 3], 6, temperature=0) == greedy
    for t in range(1, 7):  # each greedy token is the argmax of the full forward
        ctx = torch.tensor([[1, 2, 3] + greedy[3 : 3 + t - 1]])
        assert int(model(ctx)[0, -1].argmax()) == greedy[3 + t - 1]
    a = generate_ids(model, [5], 8, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = generate_ids(model, [5], 8, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert a == b
    assert model.training  # restored


def test_vocabulary_projection_runs_in_the_autocast_dtype():
    """Under autocast the hidden states and the fp32 master weight both go to the autocast dtype, as nn.Linear
    would (casting the hidden states up to fp32 instead ran the largest GEMM of a small model in fp32)."""
    from plyx.train import lce_operands

    hidden, weight = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, w = lce_operands(hidden, weight)
    assert h.dtype == w.dtype == torch.bfloat16
    assert torch.equal(w, weight.to(torch.bfloat16))
    h, w = lce_operands(hidden, weight)  # no autocast: the hidden states follow the weight
    assert h.dtype == w.dtype == torch.float32 and w is weight
def test_lm_head_runs_in_the_autocast_dtype(monkeypatch) -> None:
    """Under bf16 autocast the fused loss gets bf16 hidden states and a bf16 copy of the fp32 weight (the lm-head
    GEMMs at the tensor-core rate, as ``nn.Linear`` under autocast), and the fp32 weight still gets its
    gradient; without autocast nothing is cast."""
    import plyx.train._loss as loss_module

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    original = loss_module.linear_cross_entropy

    def spy(hidden, weight, targets, **options):  # type: ignore[no-untyped-def]
        seen.append((hidden.dtype, weight.dtype))
        return original(hidden, weight, targets, **options)

    monkeypatch.setattr(loss_module, "linear_cross_entropy", spy)
    model = _model()
    x, y = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 9))
    full = lm_loss(model, Batch(input_ids=x, targets=y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = lm_loss(model, Batch(input_ids=x, targets=y))
    mixed.backward()
    assert seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    head = model.lm_head_weight
    assert head.grad is not None and head.grad.dtype == torch.float32 and head.grad.abs().sum() > 0
    assert abs(mixed.item() - full.item()) < 0.05 * full.item()  # bf16 rounding, same loss
