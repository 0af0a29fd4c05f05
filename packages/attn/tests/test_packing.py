"""Packed projections: weights restacked in place, same parameters and values, found again or refused."""

from __future__ import annotations

import torch
from plyx.attn import pack_linears_, packed_linear
from torch import nn


def _linears(bias: bool):
    torch.manual_seed(0)
    return [nn.Linear(8, n, bias=bias) for n in (6, 2, 2)]


def test_packing_keeps_parameters_and_values():
    lins = _linears(bias=True)
    params = [p for lin in lins for p in lin.parameters()]
    before = [p.detach().clone() for p in params]
    assert packed_linear(lins) is None  # separate allocations
    pack_linears_(lins)
    assert [p for lin in lins for p in lin.parameters()] == params  # the same Parameter objects
    for p, old in zip(params, before):
        torch.testing.assert_close(p, old, rtol=0, atol=0)
    weight, bias = packed_linear(lins)
    torch.testing.assert_close(weight, torch.cat([lin.weight for lin in lins]), rtol=0, atol=0)
    torch.testing.assert_close(bias, torch.cat([lin.bias for lin in lins]), rtol=0, atol=0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(nn.functional.linear(x, weight, bias), torch.cat([lin(x) for lin in lins], -1))


def test_an_update_in_place_shows_in_the_stack_and_a_replacement_voids_it():
    lins = _linears(bias=False)
    pack_linears_(lins)
    with torch.no_grad():
        lins[1].weight.add_(1.0)  # an optimizer step: in place
    weight, bias = packed_linear(lins)
    assert bias is None
    torch.testing.assert_close(weight[6:8], lins[1].weight, rtol=0, atol=0)
    lins[2].weight = nn.Parameter(lins[2].weight.detach().clone())  # load_state_dict(assign=True), .to(): new storage
    assert packed_linear(lins) is None
    pack_linears_(lins)  # packing again works
    assert packed_linear(lins) is not None


def test_gradients_still_flow_through_packed_parameters():
    lins = _linears(bias=True)
    pack_linears_(lins)
    x = torch.randn(4, 8)
    sum(lin(x).square().sum() for lin in lins).backward()
    assert all(lin.weight.grad is not None and lin.weight.grad.shape == lin.weight.shape for lin in lins)


def test_adjacent_but_separate_tensors_are_not_a_stack():
    """Two allocations that happen to sit back to back are not one buffer (the CUDA allocator does this)."""
    block = torch.zeros(8, 4)
    lins = [nn.Linear(4, 4, bias=False) for _ in range(2)]
    lins[0].weight.data = block[:4]
    lins[1].weight.data = block[4:].clone()  # its own storage, wherever it lands
    assert packed_linear(lins) is None
    lins[1].weight.data = block[4:]
    assert packed_linear(lins) is not None


class _Wrapped(nn.Linear):
    """A linear whose output is not its weight's alone unless it says so (an adapter, a quantized base...)."""

    exact = False

    @property
    def weight_is_effective(self) -> bool:
        return self.exact

    def forward(self, x):
        return super().forward(x) if self.exact else super().forward(x) + 1.0


def test_linears_whose_output_is_not_their_weight_are_not_read_packed():
    from plyx.attn import weight_reads_exact

    lins = _linears(bias=False)
    lins[1].__class__ = _Wrapped
    assert weight_reads_exact(lins[0]) and not weight_reads_exact(lins[1])
    assert not weight_reads_exact(nn.Identity())  # no weight_is_effective: not exact
    pack_linears_(lins)
    assert packed_linear(lins) is None  # packed, but a packed GEMV would skip the wrapper's +1
    ptr = lins[0].weight.data_ptr()
    pack_linears_(lins)  # already packed: nothing is restacked
    assert lins[0].weight.data_ptr() == ptr
    _Wrapped.exact = True
    try:
        weight, _ = packed_linear(lins)
        torch.testing.assert_close(weight, torch.cat([lin.weight for lin in lins]), rtol=0, atol=0)
    finally:
        _Wrapped.exact = False
