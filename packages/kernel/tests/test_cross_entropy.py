"""Triton cross-entropy (ignore_index, smoothing, z-loss, reductions, argmax) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import cross_entropy as reference
from plyx.kernel.triton_ops._common import num_programs
from plyx.kernel.triton_ops.cross_entropy import _split_plan, ce_rows, cross_entropy

from .conftest import GPU, TOLERANCES, TRITON_DEVICE, rel_max_err

# (N, V): the interpreter's vocabulary block is 256 columns, so 257 and 600 straddle it
SHAPES = [(1, 2), (7, 67), (5, 257), (3, 600)]
if GPU:
    SHAPES += [(64, 32000), (9, 128256), (4, 16385)]

OPTIONS = [
    {},
    {"label_smoothing": 0.1, "z_loss": 1e-3},
    {"reduction": "sum", "return_argmax": True},
    {"reduction": "none", "label_smoothing": 0.05},
]


def _targets(n: int, v: int, ignored: float = 0.25) -> torch.Tensor:
    t = torch.randint(0, v, (n,))
    t[torch.rand(n) < ignored] = -100
    return t.to(TRITON_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_reference(parity, make, shape, dtype, options):
    n, v = shape
    t = _targets(n, v)
    z = make(n, v, dtype=dtype, scale=4.0)
    # losses are judged relative to max(|loss|, 1 nat) and gradients relative to max(|grad|, 1/N): a
    # confident row's p - 1 is a cancellation float32 only resolves to ~1e-7 absolute (see rel_max_err)
    parity(lambda z: cross_entropy(z, t, **options), lambda z: reference(z, t, **options), [z], grad=(0,),
           dtype=dtype, label=f"cross_entropy {shape} {options}", floor=1.0, grad_floor=1.0 / n)


def test_all_rows_ignored_gives_zero_loss_and_gradient(make):
    z = make(4, 50).requires_grad_(True)
    loss = cross_entropy(z, torch.full((4,), -100, device=TRITON_DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


def test_argmax_matches_torch_on_ties_and_blocks(make):
    z = make(3, 700)
    z[0, 5] = z[0, 400] = 1e4  # a tie across blocks: the first index wins, as torch.argmax
    z[1, 699] = 1e4  # the last column of the last, partial block
    _, argmax = cross_entropy(z, torch.zeros(3, dtype=torch.long, device=TRITON_DEVICE), return_argmax=True)
    assert argmax.dtype == torch.int64 and argmax.tolist() == z.argmax(-1).tolist()
    assert argmax[:2].tolist() == [5, 699]


def test_bad_inputs_name_kernel_and_argument():
    z = torch.randn(4, 10, device=TRITON_DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"cross_entropy:triton.*`targets`.*\[4\]"):
        cross_entropy(z, t[:3])
    with pytest.raises(KernelInputError, match=r"`targets`.*int64.*\.long\(\)"):
        cross_entropy(z, t.float())
    with pytest.raises(KernelInputError, match=r"`logits`.*\[N, V\]"):
        cross_entropy(z[None], t)
    with pytest.raises(KernelInputError, match=r"`reduction`.*mean, sum, none"):
        cross_entropy(z, t, reduction="avg")
    with pytest.raises(KernelInputError, match=r"`label_smoothing`"):
        cross_entropy(z, t, label_smoothing=1.5)
    with pytest.raises(KernelInputError, match=r"reference.*`targets`.*id 10 outside \[0, 10\)"):
        reference(z, torch.full((4,), 10, device=TRITON_DEVICE))


def test_forward_computes_no_gradient_buffer(make, monkeypatch):
    """The forward never writes an [N, V] gradient (one read of the logits: loss and lse); the backward writes it
    in one pass from the saved lse, and only when a gradient is asked for (issue 19: no extra pass, no sync)."""
    from plyx.kernel.triton_ops import cross_entropy as module

    seen, grads = [], []
    real, real_grad = module.ce_rows, module.ce_grad
    monkeypatch.setattr(module, "ce_rows", lambda *a, **k: seen.append(k["dz"]) or real(*a, **k))
    monkeypatch.setattr(module, "ce_grad", lambda *a, **k: grads.append(1) or real_grad(*a, **k))
    z = make(5, 70).requires_grad_(True)
    t = torch.randint(0, 70, (5,), device=TRITON_DEVICE)
    with torch.no_grad():
        a = cross_entropy(z, t)
    b = cross_entropy(z, t)
    assert seen == [None, None] and grads == []
    (dz,) = torch.autograd.grad(b, z)
    assert grads == [1] and not a.requires_grad and torch.allclose(a, b.detach())
    want = torch.autograd.grad(torch.nn.functional.cross_entropy(z.double(), t), z)[0]
    assert torch.allclose(dz.double(), want.double(), rtol=1e-4, atol=1e-6)


# ---- split-vocabulary forward (no gradient, few rows): the tests split in 16-column blocks (the
# interpreter's default; forced on GPUs by ``small_chunks``), so V = 17 and 20 leave a last chunk of 1 and
# 4 columns, 67 and 1000 end mid-block, and splits=7 over 20 columns is capped at the 2 chunks that fit


@pytest.fixture
def small_chunks(monkeypatch):
    from plyx.kernel.triton_ops import cross_entropy as module

    monkeypatch.setitem(module.SPLIT, "block", 16)


def _split_oracle(z: torch.Tensor, t: torch.Tensor, eps: float, z_loss: float):
    """float64 loss rows (reduction none), lse and argmax."""
    z64 = z.double()
    loss = reference(z64, t, label_smoothing=eps, z_loss=z_loss, reduction="none")
    return loss, torch.logsumexp(z64, dim=-1), z.argmax(dim=-1)


def _split(z: torch.Tensor, t: torch.Tensor, splits: int | None, eps: float = 0.0, z_loss: float = 0.0):
    from plyx.kernel.triton_ops._common import poisoned

    with poisoned():
        return ce_rows(z, t, ignore_index=-100, eps=eps, z_loss=z_loss, scale=None, dz=None, argmax=True,
                       splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("v", [17, 20, 67, 600, 1000])
@pytest.mark.parametrize("splits", [2, 7])
@pytest.mark.parametrize("eps,z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_split_forward_matches_reference(make, small_chunks, fresh_seed, dtype, v, splits, eps, z_loss):
    n = 4
    assert _split_plan(torch.device(TRITON_DEVICE), n, v, splits)[0] > 1  # the split kernels do run
    z = make(n, v, dtype=dtype, scale=4.0)
    t = _targets(n, v)
    t[1] = -100  # an ignored row: loss 0, lse and argmax still computed
    loss, lse, argmax = _split(z, t, splits, eps, z_loss)
    want_loss, want_lse, want_argmax = _split_oracle(z, t, eps, z_loss)
    tol = TOLERANCES[dtype][0]
    where = f"V={v} splits={splits} {dtype} eps={eps} z_loss={z_loss} seed={fresh_seed}"
    assert rel_max_err(loss, want_loss, floor=1.0) <= tol, where
    assert rel_max_err(lse, want_lse, floor=1.0) <= tol, where
    assert loss[1].item() == 0.0, where
    assert argmax.dtype == torch.int64 and torch.equal(argmax.cpu(), want_argmax.cpu()), where


def test_split_is_the_default_for_few_rows_without_gradient(make, monkeypatch):
    """Greedy decoding's call (no grad, reduction none, argmax) at batch 1 takes the split path."""
    from plyx.kernel.triton_ops import cross_entropy as module

    ran = []
    real = module._ce_split
    monkeypatch.setattr(module, "_ce_split", lambda *a: ran.append(a[-3]) or real(*a))
    v = 32000 if GPU else 600
    z = make(1, v, scale=4.0)
    t = torch.zeros(1, dtype=torch.long, device=TRITON_DEVICE)
    with torch.no_grad():
        loss, argmax = cross_entropy(z, t, reduction="none", return_argmax=True)
    want_loss, _, want_argmax = _split_oracle(z, t, 0.0, 0.0)
    assert ran and ran[0] > 1
    assert rel_max_err(loss, want_loss, floor=1.0) <= TOLERANCES[torch.float32][0]
    assert torch.equal(argmax.cpu(), want_argmax.cpu())
    # as many rows as programs, or a gradient, keep one program per row
    many = (num_programs(torch.device("cuda"), 1 << 30, per_sm=module.SPLIT["per_sm"]) if GPU
            else module.SPLIT["interpreter_programs"])
    ran.clear()
    with torch.no_grad():
        cross_entropy(make(many, v), torch.zeros(many, dtype=torch.long, device=TRITON_DEVICE))
    assert not ran
    # with a gradient the forward splits too (it writes no gradient; the backward reads its lse)
    leaf = z.detach().requires_grad_(True)
    (dz,) = torch.autograd.grad(cross_entropy(leaf, t), leaf)
    assert ran and ran[0] > 1
    want = torch.autograd.grad(torch.nn.functional.cross_entropy(leaf.double(), t), leaf)[0]
    assert torch.allclose(dz.double(), want.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("splits", [2, 7])
def test_split_ties_across_chunks_return_lowest_index(make, small_chunks, splits):
    v = 600
    chunk = _split_plan(torch.device(TRITON_DEVICE), 4, v, splits)[1]
    z = make(4, v)
    z[0, 5] = z[0, v - 1] = 1e4  # first and last chunk
    z[1, chunk - 1] = z[1, chunk] = 1e4  # the two sides of a chunk boundary
    z[2, chunk + 3] = z[2, min(2 * chunk + 1, v - 2)] = 1e4  # second and third chunks (or later in the second)
    z[3] = 0.0  # every column ties: column 0
    _, _, argmax = _split(z, torch.zeros(4, dtype=torch.long, device=TRITON_DEVICE), splits)
    assert argmax.tolist() == [5, chunk - 1, chunk + 3, 0] == z.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forced_splits_agree(make, small_chunks, fresh_seed, dtype):
    z = make(3, 1000, dtype=dtype, scale=4.0)
    t = _targets(3, 1000)
    outs = [_split(z, t, s, eps=0.1, z_loss=1e-3) for s in (1, 2, 7)]
    for s, (loss, lse, argmax) in zip((2, 7), outs[1:]):
        # float32 sums in a different order: equal to rounding, the argmax exactly
        assert rel_max_err(loss, outs[0][0], floor=1.0) <= 1e-5, f"splits={s} seed={fresh_seed}"
        assert rel_max_err(lse, outs[0][1], floor=1.0) <= 1e-5, f"splits={s} seed={fresh_seed}"
        assert torch.equal(argmax, outs[0][2]), f"splits={s} seed={fresh_seed}"


# the discarded loss of these rows is inf/NaN (0 * -inf smoothing term, log 0): numpy warns in the interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_masked_logits_give_finite_lse_and_argmax(make, small_chunks, splits):
    """-inf logits (a sampler's mask) filling whole blocks or chunks, even the first, do not turn lse into NaN."""
    z = make(3, 600)
    z[0, :400] = float("-inf")  # the first chunk(s) only -inf
    z[1, 300:] = float("-inf")  # the last chunk(s) only -inf
    z[2] = float("-inf")  # everything masked: lse -inf, argmax 0 as torch
    _, lse, argmax = _split(z, torch.zeros(3, dtype=torch.long, device=TRITON_DEVICE), splits)
    want = torch.logsumexp(z.double(), dim=-1)
    assert rel_max_err(lse[:2], want[:2], floor=1.0) <= TOLERANCES[torch.float32][0]
    assert lse[2].item() == float("-inf")
    assert argmax.tolist() == z.argmax(-1).tolist()


def test_splits_only_without_gradient(make):
    z = make(2, 50)
    t = torch.zeros(2, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"splits=2.*gradient `dz`"):
        ce_rows(z, t, ignore_index=-100, eps=0.0, z_loss=0.0, scale=torch.ones(1, device=TRITON_DEVICE),
                dz=torch.empty_like(z), splits=2)
    with pytest.raises(ValueError, match=r"splits=0 must be >= 1"):
        ce_rows(z, t, ignore_index=-100, eps=0.0, z_loss=0.0, scale=None, dz=None, splits=0)


# ---- inplace=True: the gradient in the forward's one pass, over the caller's logits (Liger's scheme)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(7, 67), (3, 600)], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("unit", [True, False], ids=["g=1", "g=random"])
def test_inplace_matches_reference(make, fresh_seed, shape, dtype, options, unit):
    """Loss and gradient against float64 for loss.backward()'s unit gradient and a random one (per row for
    reduction none); the gradient is the logits' own storage."""
    n, v = shape
    t = _targets(n, v)
    z = make(n, v, dtype=dtype, scale=4.0)
    z64 = z.detach().double().requires_grad_(True)
    want = reference(z64, t, **{k: w for k, w in options.items() if k != "return_argmax"})
    leaf = z.detach().clone().requires_grad_(True)
    out = cross_entropy(leaf, t, inplace=True, **options)
    loss = out[0] if options.get("return_argmax") else out
    g = torch.ones_like(loss) if unit else torch.randn_like(loss)
    (dz,) = torch.autograd.grad(loss, leaf, g)
    (want_dz,) = torch.autograd.grad(want, z64, g.double())
    tol_out, tol_grad = TOLERANCES[dtype]
    where = f"{shape} {dtype} {options} unit={unit} seed={fresh_seed}"
    assert rel_max_err(loss, want, floor=1.0) <= tol_out, where
    assert rel_max_err(dz, want_dz, floor=float(g.abs().max()) / n) <= tol_grad, where
    assert dz.data_ptr() == leaf.data_ptr(), "the gradient is written over the logits"
    if options.get("return_argmax"):
        assert torch.equal(out[1], z.argmax(-1)), where


def test_inplace_backward_twice_is_refused(make):
    z = make(3, 40).requires_grad_(True)
    loss = cross_entropy(z, torch.zeros(3, dtype=torch.long, device=TRITON_DEVICE), inplace=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward ran twice.*inplace=False"):
        loss.backward()


def test_inplace_without_gradient_leaves_logits(make):
    z = make(4, 90)
    before = z.clone()
    with torch.no_grad():
        loss = cross_entropy(z, torch.zeros(4, dtype=torch.long, device=TRITON_DEVICE), inplace=True)
    assert torch.equal(z, before) and torch.allclose(loss, torch.nn.functional.cross_entropy(before, torch.zeros(
        4, dtype=torch.long, device=TRITON_DEVICE)), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scale_in_place(make, dtype):
    """scale_: the float32 product stored in x's dtype, for one factor or one per row, 1.0 rows untouched."""
    from plyx.kernel.triton_ops.cross_entropy import scale_

    x = make(4, 300, dtype=dtype)
    for g in (torch.tensor(1.0), torch.tensor(-2.5), torch.tensor([1.0, 3.0, 1.0, -0.5]), torch.tensor([0.25])):
        g = g.to(TRITON_DEVICE)
        y = x.clone()
        assert scale_(y, g) is y
        factor = g.reshape(-1, 1) if g.numel() == 4 else g
        # the cast to bfloat16 may round either way (the interpreter's is not round-to-nearest): one unit
        want = (x.float() * factor).to(dtype)
        assert torch.allclose(y.float(), want.float(), rtol=2**-7 if dtype == torch.bfloat16 else 0, atol=0), g
        if g.numel() == 4:
            assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2]), "a factor of exactly 1 leaves the row"
    y = make(0, 5, dtype=dtype)
    assert scale_(y, torch.tensor(2.0, device=TRITON_DEVICE)).shape == (0, 5)
