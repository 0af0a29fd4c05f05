"""Triton RMSNorm (with and without the fused residual add) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import rmsnorm as reference
from plyx.kernel.triton_ops.rmsnorm import rmsnorm

from .conftest import GPU, TOLERANCES, TRITON_DEVICE, rel_max_err

# hidden sizes (D=1 is left out: its gradient is pure cancellation, eps/(x^2+eps)): tiny, odd, one past a power of two (the masked tail of BLOCK), a power of two
SHAPES = [(1, 5), (4, 37), (3, 5, 130), (7, 257), (2, 256)]
if GPU:
    SHAPES += [(64, 4096), (33, 5120), (5, 14336)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(parity, make, shape, dtype, residual):
    x = make(*shape, dtype=dtype)
    w = make(shape[-1], dtype=dtype, scale=0.1, shift=1.0)
    if residual:
        r = make(*shape, dtype=dtype)
        parity(lambda x, w, r: rmsnorm(x, w, eps=1e-5, residual=r), lambda x, w, r: reference(x, w, eps=1e-5, residual=r),
               [x, w, r], grad=(0, 1, 2), dtype=dtype, label=f"rmsnorm residual {shape}")
    else:
        parity(lambda x, w: rmsnorm(x, w, eps=1e-5), lambda x, w: reference(x, w, eps=1e-5), [x, w], grad=(0, 1),
               dtype=dtype, label=f"rmsnorm {shape}")


def test_strided_rows_are_read_in_place(parity, make):
    base = make(6, 80)
    x = base[:, :40]  # row stride 80, last dim contiguous
    w = make(40)
    parity(lambda x, w: rmsnorm(x, w), lambda x, w: reference(x, w), [x, w], grad=(0, 1), label="strided rows")


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"rmsnorm:triton.*`weight`.*\[8\]"):
        rmsnorm(x, torch.ones(7, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`x`.*int64"):
        rmsnorm(torch.ones(4, 8, dtype=torch.long, device=TRITON_DEVICE), torch.ones(8, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`x`.*stride 4.*contiguous"):
        rmsnorm(torch.randn(8, 4, device=TRITON_DEVICE).T, torch.ones(8, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`residual`.*shape"):
        rmsnorm(x, torch.ones(8, device=TRITON_DEVICE), residual=torch.randn(4, 9, device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`eps`"):
        reference(x, torch.ones(8, device=TRITON_DEVICE), eps=-1.0)
    with pytest.raises(KernelInputError, match=r"`weight`: is on meta but `x` is on"):
        reference(x, torch.ones(8, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p,d", [(1, 5), (3, 64), (70, 300)])
def test_dw_reduce_sums_partials_in_one_launch(make, dtype, p, d):
    """The backward's dw: float32 partials [P, D] summed over P (several P steps and column programs)."""
    from plyx.kernel.triton_ops.rmsnorm import DW_BLOCK, _dw_reduce

    partial = make(p, d)
    dw = torch.full((d,), float("nan"), dtype=dtype, device=TRITON_DEVICE)
    _dw_reduce[(-(-d // DW_BLOCK["d"]),)](partial, dw, p, d, BLOCK_P=DW_BLOCK["p"], BLOCK_D=DW_BLOCK["d"])
    want = partial.double().sum(0)
    assert rel_max_err(dw, want) <= TOLERANCES[dtype][0]


class _Compiled:
    """Stands in for a CompiledKernel: records direct launches."""

    packed_metadata = ("packed",)
    function = "fn"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *call):
        self.runs.append(call)


class _Jit:
    """Stands in for a @triton.jit function: kernel[grid](*args, **meta) returns its compiled kernel."""

    def __init__(self) -> None:
        self.compiled = _Compiled()
        self.jit_calls: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            return self.compiled
        return run


def test_direct_launch_caches_per_key_and_device(monkeypatch):
    """launch(): the first call of a key goes through the JIT and keeps its compiled kernel; later calls of
    that key (on that device) launch it directly with every argument and the grid; key None always JITs."""
    from plyx.kernel.triton_ops import _common

    monkeypatch.setattr(_common, "DIRECT_LAUNCH", True)
    device = [0]
    monkeypatch.setattr(_common, "_current_device", lambda: device[0])
    monkeypatch.setattr(_common, "_current_stream", lambda d: f"stream{d}")
    kernel, cache = _Jit(), {}
    _common.launch(cache, ("bf16", 64), kernel, (8, 1, 1), (1, 2, 3), num_warps=4)
    _common.launch(cache, ("bf16", 64), kernel, (5, 2, 1), (4, 5, 6), num_warps=4)
    assert len(kernel.jit_calls) == 1 and kernel.jit_calls[0][2] == {"num_warps": 4}
    (call,) = kernel.compiled.runs
    assert call[:6] == (5, 2, 1, "stream0", "fn", ("packed",)) and call[-3:] == (4, 5, 6)
    _common.launch(cache, ("f32", 64), kernel, (1, 1, 1), (7,))  # another key: JIT again
    device[0] = 1
    _common.launch(cache, ("bf16", 64), kernel, (1, 1, 1), (8,))  # another device: JIT again
    _common.launch(cache, None, kernel, (1, 1, 1), (9,))  # no key: JIT, nothing cached
    assert len(kernel.jit_calls) == 4 and len(kernel.compiled.runs) == 1 and len(cache) == 3
    monkeypatch.setattr(_common, "DIRECT_LAUNCH", False)
    _common.launch(cache, ("bf16", 64), kernel, (1, 1, 1), (10,))
    assert len(kernel.jit_calls) == 5 and len(kernel.compiled.runs) == 1


def test_keys_follow_triton_specialisation():
    from plyx.kernel.triton_ops.rmsnorm import _aligned, _ints

    assert _ints(32, 1, 7) == (True, False, False, False, True, False, False, False, False)
    assert _ints(1 << 31) == (True, False, True)
    t = torch.zeros(8)
    assert _aligned(t) and not _aligned(t[1:]) and _aligned(t, t[4:])


@pytest.mark.skipif(not GPU, reason="the direct launch runs compiled kernels (CUDA)")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_direct_launch_matches_jit_launch(monkeypatch, make, residual):
    """The cached compiled kernels launched directly give bit for bit the JIT launch's outputs and gradients,
    forward and backward (the second call of each key is a direct launch)."""
    from plyx.kernel.triton_ops import _common
    from plyx.kernel.triton_ops import rmsnorm as op

    supported = _common.DIRECT_LAUNCH
    for cache in ("_FWD", "_BWD", "_DW"):
        monkeypatch.setattr(op, cache, {})
    x, w, r, g = (make(33, 4096, dtype=torch.bfloat16) for _ in range(4))
    outs = {}
    for direct in (False, True):
        monkeypatch.setattr(_common, "DIRECT_LAUNCH", direct and supported)
        for _ in range(2):
            xl, wl, rl = (t.detach().clone().requires_grad_(True) for t in (x, w[0], r))
            out = op.rmsnorm(xl, wl, eps=1e-5, residual=rl if residual else None)
            y = out[0] if residual else out
            torch.autograd.backward(y, g)
        outs[direct] = [y, xl.grad, wl.grad] + ([out[1], rl.grad] if residual else [])
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    if supported:
        assert op._FWD and op._BWD and op._DW, "each kernel's compiled handle was cached"
