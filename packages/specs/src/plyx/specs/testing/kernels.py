"""Conformance kit for kernel implementations: each against a float64 oracle, forward and gradients.

Usage (any distribution, any implementation of a known kernel name)::

    from plyx.specs.testing.kernels import check_kernel, assert_kernel_conforms

    report = check_kernel("rmsnorm", my_rmsnorm, device="cuda", dtypes=("float32", "bfloat16"))
    assert report.ok, report.failures
    assert_kernel_conforms("rmsnorm", my_rmsnorm)              # raises AssertionError with every failure

    check_registry(registry, device="cpu")                     # every implementation a registry discovered

Each kernel name has a few cases (``KERNEL_CASES``): small inputs drawn fresh
from a seeded generator, including sizes that are not powers of two, and an
oracle: the kernel's contract written as plain float64 torch. The inputs are
made in the dtype under test; the oracle sees the same values upcast to
float64, so the error measured is the implementation's own. A case passes when
every floating output has the case's declared dtype (the input dtype, or
float32 for losses) and it and every gradient (of a random projection of the
outputs) is within ``tolerance(dtype, case.reduction)`` of the oracle, relative
to the oracle's largest magnitude, and integer outputs (argmax) match exactly.

Tolerances come from an error model, not from what a kernel happened to reach
(``tolerance``): the inputs are exact in their dtype (the oracle sees the same
values), a correct implementation accumulates in float32 (float64 for float64)
and rounds to the dtype at most ``r`` times along any path, so its error is at
most ``r * u(dtype) + c * sqrt(K) * u(acc)`` relative to the largest output,
with ``u`` the unit roundoff (2^-8 for bfloat16, 2^-11 for float16, 2^-24 for
float32), ``K`` the longest sum an output element depends on, ``sqrt(K)`` the
probabilistic bound of a K-term sum (Higham & Mary, SIAM J. Sci. Comput. 2019)
and ``c = 8`` room for reordered sums and approximate transcendental functions
of a few ulps on GPUs. Outputs allow ``r = 2`` (an intermediate and the
output); gradients ``r = 4`` (the backward re-reads rounded values and rounds
a product and its own output). In bfloat16 an output is held to 7.8e-3: a
1% bias fails.

The kernel signatures (positional tensors first, options keyword-only)::

    matmul(a [..., M, K], b [K, N]) -> a @ b
    rmsnorm(x [..., D], weight [D], *, eps=1e-6, residual=None) -> y | (y, x + residual)
    swiglu(gate, up) -> silu(gate) * up
    rope(x [B, T, H, Dh], cos, sin [T, R/2] | [B, T, R/2], *, interleaved=False) -> x rotated on its first R dims
    cross_entropy(logits [N, V], targets [N], *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  reduction="mean", return_argmax=False) -> loss | (loss, argmax [N])
    linear_cross_entropy(hidden [N, D], weight [V, D], targets [N], *, bias=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, reduction="mean") -> loss
    moe_permute(x [T, D], expert_ids [T, k], *, num_experts) -> (xs [T*k, D], positions [T, k], offsets [E+1])
    moe_unpermute(ys [T*k, D], positions [T, k], weights [T, k]) -> out [T, D]
    grouped_gemm(x [M, K], weight [E, N, K], offsets [E+1]) -> y [M, N]

torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

__all__ = [
    "KERNEL_CASES",
    "TOLERANCES",
    "UNIT_ROUNDOFF",
    "add_cases",
    "tolerance",
    "CaseResult",
    "KernelCase",
    "ConformanceReport",
    "check_kernel",
    "assert_kernel_conforms",
    "check_registry",
]

#: unit roundoff u = 2^-p of each dtype (p: significand bits, the implicit one included)
UNIT_ROUNDOFF: dict[str, float] = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: the dtype a correct implementation accumulates in, per input dtype
_ACCUMULATE = {"float64": "float64", "float32": "float32", "float16": "float32", "bfloat16": "float32"}
_ROUNDINGS = {False: 2, True: 4}  # outputs, gradients: see the module docstring
_SUM_SLACK = 8.0  # c: reordered sums, approximate exp/rsqrt of a few ulps
_MIN_TERMS = 16  # even elementwise kernels get sqrt(16) ulps of the accumulation dtype


def tolerance(dtype: str, reduction: int = 1, *, grad: bool = False) -> float:
    """Error allowed relative to the oracle's largest magnitude, from the error model of the module docstring.

    Args:
        dtype: the dtype under test (``bfloat16``...).
        reduction: K, the longest sum one output element depends on (a matmul's inner size, a norm's width).
        grad: the tolerance of gradients instead of outputs.

    Returns:
        ``r * u(dtype) + c * sqrt(K) * u(accumulation dtype)``.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise KeyError(f"no error model for dtype {dtype!r} (known: {', '.join(UNIT_ROUNDOFF)})")
    u, u_acc = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[_ACCUMULATE[dtype]]
    return _ROUNDINGS[grad] * u + _SUM_SLACK * max(reduction, _MIN_TERMS) ** 0.5 * u_acc


#: dtype -> (output, gradient) tolerance of an elementwise case (``tolerance(dtype, 1)``); kept for callers of 1.1
TOLERANCES: dict[str, tuple[float, float]] = {d: (tolerance(d), tolerance(d, grad=True)) for d in UNIT_ROUNDOFF}


@attrs.frozen
class KernelCase:
    """One input set of a kernel name and how to judge it.

    Attributes:
        label: shown in failures (``rmsnorm residual [2, 3, 130]``).
        make: ``(torch, generator, dtype, device) -> (args, kwargs, grad_args)``; ``grad_args`` are the
            indices of the positional args (or ``"kw:name"``) that gradients are checked for.
        oracle: the contract in float64: ``(*args64, **kwargs) -> output(s)``.
        scale_floor: outputs are judged relative to ``max(max |oracle|, scale_floor)``; losses use 1.0
            (a loss of 1e-4 nats is a difference of two logits-sized numbers, so float32 can only be
            held to its error relative to 1 nat).
        reduction: K of the error model: the longest sum one output element depends on.
        output_dtype: the dtype every floating output must have; None means the inputs' dtype
            (losses are float32 whatever the logits' dtype).
    """

    label: str
    make: Callable[..., tuple[list[Any], dict[str, Any], tuple[Any, ...]]] = attrs.field(eq=False)
    oracle: Callable[..., Any] = attrs.field(eq=False)
    scale_floor: float = 1e-6
    reduction: int = 1
    output_dtype: str | None = None


@attrs.frozen
class CaseResult:
    """One case in one dtype, one direction: what ``plyx kernels check`` prints a line for.

    Attributes:
        case: the case label; ``dtype``, ``device`` where it ran; ``direction``: ``forward`` or ``backward``.
        status: ``pass``, ``fail`` or ``skip`` (outside the declared capability, over the time budget,
            or backward not run after a failing forward); ``detail`` says why.
    """

    case: str
    dtype: str
    device: str
    direction: str
    status: str
    detail: str = ""


@attrs.frozen
class ConformanceReport:
    """What ``check_kernel`` found: ``ok`` when no failure."""

    name: str
    impl: str
    device: str
    dtypes: tuple[str, ...]
    checked: int
    failures: tuple[str, ...] = ()
    results: tuple[CaseResult, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------
# oracles: each kernel's contract in float64
# ---------------------------------------------------------------------------
def _oracle_matmul(a: Any, b: Any) -> Any:
    return a @ b


def _oracle_rmsnorm(x: Any, w: Any, *, eps: float = 1e-6, residual: Any = None) -> Any:
    h = x if residual is None else x + residual
    y = h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w
    return y if residual is None else (y, h)


def _oracle_swiglu(g: Any, u: Any) -> Any:
    return g * g.sigmoid() * u


def _oracle_rope(x: Any, cos: Any, sin: Any, *, interleaved: bool = False) -> Any:
    torch = _torch()
    r = 2 * cos.shape[-1]
    c = (cos if cos.dim() == 3 else cos[None])[:, :, None, :]
    s = (sin if sin.dim() == 3 else sin[None])[:, :, None, :]
    xr = x[..., :r]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((out, x[..., r:]), dim=-1)


def _ce_rows(z: Any, t: Any, ignore_index: int, eps: float, z_loss: float) -> tuple[Any, Any]:
    torch = _torch()
    lse = torch.logsumexp(z, -1)
    valid = t != ignore_index
    zt = z.gather(1, torch.where(valid, t, 0).long()[:, None])[:, 0]
    rows = lse - (1 - eps) * zt - eps * z.mean(-1) + z_loss * lse * lse
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def _reduce(rows: Any, valid: Any, reduction: str) -> Any:
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


def _oracle_cross_entropy(z: Any, t: Any, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                          z_loss: float = 0.0, reduction: str = "mean", return_argmax: bool = False) -> Any:
    rows, valid = _ce_rows(z, t, ignore_index, label_smoothing, z_loss)
    loss = _reduce(rows, valid, reduction)
    return (loss, z.argmax(-1)) if return_argmax else loss


def _oracle_linear_cross_entropy(h: Any, w: Any, t: Any, *, bias: Any = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean") -> Any:
    z = h @ w.T
    if bias is not None:
        z = z + bias
    rows, valid = _ce_rows(z, t, ignore_index, label_smoothing, z_loss)
    return _reduce(rows, valid, reduction)


def _oracle_moe_permute(x: Any, expert_ids: Any, *, num_experts: int) -> Any:
    # a stable sort by expert: expert 0's rows first, token order within each expert
    torch = _torch()
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(flat.numel(), device=flat.device)
    counts = torch.stack([(flat == e).sum() for e in range(num_experts)])
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    return x[order // expert_ids.shape[1]], positions.view(expert_ids.shape), offsets


def _oracle_moe_unpermute(ys: Any, positions: Any, weights: Any) -> Any:
    return (ys[positions.long()] * weights[..., None]).sum(1)


def _oracle_grouped_gemm(x: Any, weight: Any, offsets: Any) -> Any:
    torch = _torch()
    bounds = offsets.tolist()
    return torch.cat([x[a:b] @ weight[e].T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------
def _rand(torch: Any, gen: Any, shape: Sequence[int], dtype: Any, device: str, scale: float = 1.0,
          shift: float = 0.0) -> Any:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(device=device, dtype=dtype)


def _targets(torch: Any, gen: Any, n: int, v: int, device: str, ignored: Sequence[int] = ()) -> Any:
    t = torch.randint(0, v, (n,), generator=gen)
    for i in ignored:
        t[i] = -100
    return t.to(device)


def _tables(torch: Any, gen: Any, shape: Sequence[int], dtype: Any, device: str) -> tuple[Any, Any]:
    angles = torch.rand(*shape, generator=gen, dtype=torch.float64) * 6.283
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def _cases() -> dict[str, tuple[KernelCase, ...]]:
    def mm(sa: Sequence[int], sb: Sequence[int]) -> Callable[..., Any]:
        return lambda torch, gen, dt, dev: ([_rand(torch, gen, sa, dt, dev), _rand(torch, gen, sb, dt, dev, 0.2)], {}, (0, 1))

    def norm(shape: Sequence[int], residual: bool, eps: float) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            x = _rand(torch, gen, shape, dt, dev)
            w = _rand(torch, gen, shape[-1:], dt, dev, 0.1, 1.0)
            kw: dict[str, Any] = {"eps": eps}
            if residual:
                kw["residual"] = _rand(torch, gen, shape, dt, dev)
            return [x, w], kw, (0, 1) + (("kw:residual",) if residual else ())
        return make

    def glu(shape: Sequence[int]) -> Callable[..., Any]:
        return lambda torch, gen, dt, dev: ([_rand(torch, gen, shape, dt, dev, 2.0), _rand(torch, gen, shape, dt, dev)], {}, (0, 1))

    def rot(shape: Sequence[int], rotary: int, batched: bool, interleaved: bool) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            b, t = shape[0], shape[1]
            cos, sin = _tables(torch, gen, (b, t, rotary // 2) if batched else (t, rotary // 2), dt, dev)
            return [_rand(torch, gen, shape, dt, dev), cos, sin], {"interleaved": interleaved}, (0,)
        return make

    def ce(n: int, v: int, ignored: Sequence[int], **options: Any) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            return [_rand(torch, gen, (n, v), dt, dev, 3.0), _targets(torch, gen, n, v, dev, ignored)], dict(options), (0,)
        return make

    def lce(n: int, d: int, v: int, bias: bool, ignored: Sequence[int], **options: Any) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            h = _rand(torch, gen, (n, d), dt, dev)
            w = _rand(torch, gen, (v, d), dt, dev, d ** -0.5 * 2)
            kw = dict(options)
            grads: tuple[Any, ...] = (0, 1)
            if bias:
                kw["bias"] = _rand(torch, gen, (v,), dt, dev, 0.5)
                grads += ("kw:bias",)
            return [h, w, _targets(torch, gen, n, v, dev, ignored)], kw, grads
        return make

    def routed(t: int, d: int, e: int, k: int) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            ids = torch.rand(t, e, generator=gen).argsort(-1)[:, :k].to(dev)  # k distinct experts per token
            return [_rand(torch, gen, (t, d), dt, dev), ids], {"num_experts": e}, (0,)
        return make

    def combine(t: int, d: int, k: int) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            positions = torch.randperm(t * k, generator=gen).view(t, k).to(dev)
            weights = torch.rand(t, k, generator=gen, dtype=torch.float64).to(device=dev, dtype=dt)
            return [_rand(torch, gen, (t * k, d), dt, dev), positions, weights], {}, (0, 2)
        return make

    def grouped(counts: Sequence[int], n: int, k: int) -> Callable[..., Any]:
        def make(torch: Any, gen: Any, dt: Any, dev: str) -> Any:
            offsets = torch.tensor([0, *counts]).cumsum(0).to(dev)
            w = _rand(torch, gen, (len(counts), n, k), dt, dev, k ** -0.5)
            return [_rand(torch, gen, (sum(counts), k), dt, dev), w, offsets], {}, (0, 1)
        return make

    f32 = "float32"  # losses are float32 whatever the logits' dtype
    return {
        "moe_permute": (
            KernelCase("moe_permute [13, 24] top-2 of 5", routed(13, 24, 5, 2), _oracle_moe_permute),
            KernelCase("moe_permute [7, 40] top-3 of 3", routed(7, 40, 3, 3), _oracle_moe_permute),
        ),
        "moe_unpermute": (
            KernelCase("moe_unpermute [11 x 2, 24]", combine(11, 24, 2), _oracle_moe_unpermute),
            KernelCase("moe_unpermute [5 x 4, 70]", combine(5, 70, 4), _oracle_moe_unpermute),
        ),
        "grouped_gemm": (
            KernelCase("grouped_gemm rows (5, 0, 17, 3) [25, 24] x [4, 40, 24]", grouped((5, 0, 17, 3), 40, 24),
                       _oracle_grouped_gemm),
            KernelCase("grouped_gemm rows (1, 33) [34, 48] x [2, 20, 48]", grouped((1, 33), 20, 48), _oracle_grouped_gemm),
        ),
        "matmul": (
            KernelCase("matmul [3, 17, 40] @ [40, 33]", mm((3, 17, 40), (40, 33)), _oracle_matmul, reduction=40),
            KernelCase("matmul [70, 64] @ [64, 96]", mm((70, 64), (64, 96)), _oracle_matmul, reduction=96),
        ),
        "rmsnorm": (
            KernelCase("rmsnorm [4, 37]", norm((4, 37), False, 1e-5), _oracle_rmsnorm, reduction=37),
            KernelCase("rmsnorm residual [2, 3, 130]", norm((2, 3, 130), True, 1e-6), _oracle_rmsnorm, reduction=130),
            KernelCase("rmsnorm [3, 64]", norm((3, 64), False, 1e-6), _oracle_rmsnorm, reduction=64),
            KernelCase("rmsnorm residual [2, 2, 128]", norm((2, 2, 128), True, 1e-5), _oracle_rmsnorm, reduction=128),
        ),
        "swiglu": (
            KernelCase("swiglu [5, 67]", glu((5, 67)), _oracle_swiglu),
            KernelCase("swiglu [2, 3, 1100]", glu((2, 3, 1100)), _oracle_swiglu),
            KernelCase("swiglu [4, 128]", glu((4, 128)), _oracle_swiglu),
        ),
        "rope": (
            KernelCase("rope rotate-half [2, 5, 3, 16]", rot((2, 5, 3, 16), 16, False, False), _oracle_rope),
            KernelCase("rope interleaved partial R=6 [2, 5, 3, 10], per-batch tables", rot((2, 5, 3, 10), 6, True, True), _oracle_rope),
            KernelCase("rope rotate-half partial R=12 [1, 7, 5, 20]", rot((1, 7, 5, 20), 12, True, False), _oracle_rope),
            KernelCase("rope rotate-half [1, 6, 2, 64]", rot((1, 6, 2, 64), 64, False, False), _oracle_rope),
        ),
        "cross_entropy": (
            KernelCase("cross_entropy [7, 67] smoothing z-loss", ce(7, 67, (2,), label_smoothing=0.1, z_loss=1e-3),
                       _oracle_cross_entropy, 1.0, reduction=7 * 67, output_dtype=f32),
            KernelCase("cross_entropy [5, 300] sum argmax", ce(5, 300, (), reduction="sum", return_argmax=True),
                       _oracle_cross_entropy, 1.0, reduction=5 * 300, output_dtype=f32),
            KernelCase("cross_entropy [6, 129] none", ce(6, 129, (0, 5), reduction="none"), _oracle_cross_entropy, 1.0,
                       reduction=129, output_dtype=f32),
            KernelCase("cross_entropy [8, 256] mean", ce(8, 256, (1,)), _oracle_cross_entropy, 1.0, reduction=8 * 256,
                       output_dtype=f32),
        ),
        "linear_cross_entropy": (
            KernelCase("linear_cross_entropy [9, 24] x [67, 24] bias smoothing",
                       lce(9, 24, 67, True, (3,), label_smoothing=0.1, z_loss=1e-3), _oracle_linear_cross_entropy, 1.0,
                       reduction=9 * 67 * 24, output_dtype=f32),
            KernelCase("linear_cross_entropy [13, 40] x [300, 40] sum", lce(13, 40, 300, False, (), reduction="sum"),
                       _oracle_linear_cross_entropy, 1.0, reduction=13 * 300 * 40, output_dtype=f32),
            KernelCase("linear_cross_entropy [8, 64] x [256, 64]", lce(8, 64, 256, False, (5,)),
                       _oracle_linear_cross_entropy, 1.0, reduction=8 * 256 * 64, output_dtype=f32),
        ),
    }


class _Cases(dict):
    """Built on first use so importing this module stays free; plyx's own names cannot be replaced.

    A plugin that brings a new kernel name adds its cases with ``add_cases``; the
    cases of a name plyx defines are the contract and no plugin may swap them for
    easier ones.
    """

    _loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for name, cases in _cases().items():
                dict.__setitem__(self, name, cases)

    def __getitem__(self, key: str) -> tuple[KernelCase, ...]:
        self._load()
        return dict.__getitem__(self, key)

    def __setitem__(self, key: str, value: tuple[KernelCase, ...]) -> None:
        self._load()
        if dict.__contains__(self, key):
            raise KeyError(f"kernel {key!r} already has conformance cases; they are part of its contract and "
                           f"cannot be replaced (a new kernel name may add its own with add_cases)")
        dict.__setitem__(self, key, tuple(value))

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"conformance cases of kernel {key!r} cannot be removed")

    def __contains__(self, key: object) -> bool:
        self._load()
        return dict.__contains__(self, key)

    def __iter__(self) -> Any:
        self._load()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._load()
        return dict.__len__(self)

    def get(self, key: str, default: Any = None) -> Any:
        self._load()
        return dict.get(self, key, default)

    def keys(self) -> Any:
        self._load()
        return dict.keys(self)

    def values(self) -> Any:
        self._load()
        return dict.values(self)

    def items(self) -> Any:
        self._load()
        return dict.items(self)


#: kernel name -> its cases; a plugin adding a new kernel name adds its own with ``add_cases``
KERNEL_CASES: dict[str, tuple[KernelCase, ...]] = _Cases()


def add_cases(name: str, *cases: KernelCase) -> None:
    """Give a new kernel name its conformance cases (a plugin that introduces the name calls this once).

    Raises:
        KeyError: ``name`` already has cases (plyx's own names always do).
    """
    if not cases:
        raise ValueError(f"add_cases({name!r}) needs at least one KernelCase")
    KERNEL_CASES[name] = cases


def _torch() -> Any:
    import torch

    return torch


def _outputs(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _pick(args: list[Any], kwargs: dict[str, Any], index: Any) -> Any:
    return kwargs[index[3:]] if isinstance(index, str) else args[index]


def _error(got: Any, want: Any, floor: float = 1e-6) -> float:
    got, want = got.detach().to("cpu", dtype=want.dtype), want.detach().cpu()
    if not want.numel():
        return 0.0
    scale = max(float(want.abs().max()), floor)
    return float((got - want).abs().max()) / scale


def _run_case(case: KernelCase, fn: Callable[..., Any], dtype_name: str, device: str, grad: bool, seed: int,
              case_filter: Callable[[list[Any], dict[str, Any]], str | None] | None = None) -> list[CaseResult]:
    """Run one case forward (and backward when ``grad``); one ``CaseResult`` per direction."""
    torch = _torch()
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    args, kwargs, grad_args = case.make(torch, gen, dtype, device)
    grad_args = grad_args if grad else ()

    def result(direction: str, status: str, detail: str = "") -> CaseResult:
        return CaseResult(case.label, dtype_name, device, direction, status, detail)

    refusal = case_filter(args, kwargs) if case_filter is not None else None
    if refusal is not None:
        return [result("forward", "skip", f"outside the declared capability: {refusal}")]
    for index in grad_args:
        _pick(args, kwargs, index).requires_grad_(True)
    where = f"{case.label} {dtype_name} on {device}"
    try:
        got = _outputs(fn(*args, **kwargs))
    except Exception as exc:  # a kernel may fail in any way; the report says how
        return [result("forward", "fail", f"{where}: raised {type(exc).__name__}: {exc}")]

    def up(t: Any) -> Any:
        return t.detach().to(dtype=torch.float64) if t.is_floating_point() else t

    args64 = [up(a) if hasattr(a, "dtype") else a for a in args]
    kwargs64 = {k: up(v) if hasattr(v, "dtype") else v for k, v in kwargs.items()}
    for index in grad_args:
        _pick(args64, kwargs64, index).requires_grad_(True)
    want = _outputs(case.oracle(*args64, **kwargs64))
    out_tol = tolerance(dtype_name, case.reduction)
    declared = getattr(torch, case.output_dtype) if case.output_dtype else dtype
    failures = []
    if len(got) != len(want):
        return [result("forward", "fail", f"{where}: returned {len(got)} output(s), the contract says {len(want)}")]
    for i, (g, w) in enumerate(zip(got, want)):
        if not hasattr(g, "shape") or tuple(g.shape) != tuple(w.shape):
            failures.append(f"{where}: output {i} has shape {tuple(getattr(g, 'shape', ()))}, expected {tuple(w.shape)}")
        elif not w.is_floating_point():
            if g.is_floating_point() or not torch.equal(g.cpu().long(), w.cpu().long()):
                failures.append(f"{where}: integer output {i} differs from the oracle (or is not an integer tensor)")
        elif g.dtype != declared:
            failures.append(f"{where}: output {i} has dtype {g.dtype}, the contract says {declared}"
                            + (" (the inputs' dtype)" if not case.output_dtype else ""))
        elif not bool(torch.isfinite(g).all()):
            failures.append(f"{where}: output {i} holds NaN or inf (an unwritten or overflowing element)")
        elif (err := _error(g, w, case.scale_floor)) > out_tol:
            failures.append(f"{where}: output {i} off by {err:.2e} (relative to its largest value), "
                            f"tolerance {out_tol:.1e}")
    forward = result("forward", "fail" if failures else "pass", "; ".join(failures))
    if failures:
        return [forward] + ([result("backward", "skip", "the forward failed")] if grad_args else [])
    if not grad_args:
        return [forward]
    # gradients of a random projection sum_i <out_i, g_i> of the floating outputs; the cotangents are
    # rounded to each output's dtype first and the oracle gets the same rounded values
    floats = [(g, w) for g, w in zip(got, want) if w.is_floating_point()]
    cotangents = [torch.randn(w.shape, generator=gen, dtype=torch.float64).to(g.dtype) for g, w in floats]
    try:
        inputs = [_pick(args, kwargs, i) for i in grad_args]
        grads = torch.autograd.grad([g for g, _ in floats], inputs,
                                    [c.to(device=g.device) for (g, _), c in zip(floats, cotangents)],
                                    allow_unused=True)
    except Exception as exc:
        return [forward, result("backward", "fail", f"{where}: backward raised {type(exc).__name__}: {exc}")]
    grads64 = torch.autograd.grad([w for _, w in floats], [_pick(args64, kwargs64, i) for i in grad_args],
                                  [c.to(device=w.device, dtype=torch.float64) for (_, w), c in zip(floats, cotangents)],
                                  allow_unused=True)
    grad_tol = tolerance(dtype_name, case.reduction, grad=True)
    for index, g, w in zip(grad_args, grads, grads64):
        if w is None:
            continue
        if g is None:
            failures.append(f"{where}: no gradient for argument {index}")
        elif tuple(g.shape) != tuple(w.shape):
            failures.append(f"{where}: gradient of argument {index} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
        elif g.dtype != _pick(args, kwargs, index).dtype:
            failures.append(f"{where}: gradient of argument {index} has dtype {g.dtype}, its input's is "
                            f"{_pick(args, kwargs, index).dtype}")
        elif not bool(torch.isfinite(g).all()):
            failures.append(f"{where}: gradient of argument {index} holds NaN or inf")
        elif (err := _error(g, w)) > grad_tol:
            failures.append(f"{where}: gradient of argument {index} off by {err:.2e}, tolerance {grad_tol:.1e}")
    return [forward, result("backward", "fail" if failures else "pass", "; ".join(failures))]


def check_kernel(
    name: str,
    fn: Callable[..., Any],
    *,
    impl: str = "",
    device: str = "cpu",
    dtypes: Iterable[str] = ("float32",),
    grad: bool = True,
    quick: bool = False,
    seed: int = 0,
    cases: Sequence[KernelCase] | None = None,
    case_filter: Callable[[list[Any], dict[str, Any]], str | None] | None = None,
    budget_ms: float | None = None,
) -> ConformanceReport:
    """Run ``fn`` (an implementation of kernel ``name``) on every case of ``name`` and compare with the oracle.

    Args:
        name: the kernel name; its cases come from ``KERNEL_CASES`` unless ``cases`` is given.
        fn: the implementation, called with the kernel name's signature.
        impl: the implementation's name, for the report.
        device: where inputs are made (``cpu``, ``cuda``).
        dtypes: dtype names to test; each has its tolerances from ``tolerance``.
        grad: also compare gradients (set False for forward-only implementations).
        quick: only the first case of each dtype (a smoke test; the registry's probe runs every case).
        seed: fresh inputs per seed; the same seed gives the same inputs.
        case_filter: ``(args, kwargs) -> None`` to run a case, or the reason to skip it (the inputs lie
            outside the implementation's declared capability: a shape limit, a multiple).
        budget_ms: stop starting new cases once this much time is spent (the rest are reported as
            skipped); the first case always runs.

    Returns:
        a ``ConformanceReport``; ``report.failures`` names the case, dtype, output and error of each failure,
        ``report.results`` has one line per case, dtype and direction.
    """
    import time

    if cases is None:
        if name not in KERNEL_CASES:
            raise KeyError(f"no conformance cases for kernel {name!r} (known: {', '.join(sorted(KERNEL_CASES.keys()))}); "
                           f"pass cases=[KernelCase(...)] for a new kernel name, or give it cases with add_cases")
        cases = KERNEL_CASES[name]
    selected = list(cases)[:1] if quick else list(cases)
    dtypes = tuple(dtypes)
    results: list[CaseResult] = []
    start = time.perf_counter()
    for dtype in dtypes:
        for i, case in enumerate(selected):
            spent = (time.perf_counter() - start) * 1e3
            if budget_ms is not None and results and spent > budget_ms:
                results.append(CaseResult(case.label, dtype, device, "forward", "skip",
                                          f"over the time budget ({spent:.0f} ms > {budget_ms:.0f} ms)"))
                continue
            results += _run_case(case, fn, dtype, device, grad, seed + i, case_filter)
    failures = tuple(r.detail for r in results if r.status == "fail")
    checked = len({(r.case, r.dtype) for r in results if r.status != "skip"})
    return ConformanceReport(name, impl, device, dtypes, checked, failures, tuple(results))


def assert_kernel_conforms(name: str, fn: Callable[..., Any], **options: Any) -> ConformanceReport:
    """``check_kernel`` that raises ``AssertionError`` listing every failure."""
    report = check_kernel(name, fn, **options)
    if not report.ok:
        raise AssertionError(f"kernel {name}{':' + report.impl if report.impl else ''} fails conformance:\n  "
                             + "\n  ".join(report.failures))
    return report


def check_registry(
    registry: Any,
    *,
    device: str = "cpu",
    dtypes: Iterable[str] = ("float32",),
    names: Iterable[str] | None = None,
    ignore_predicates: bool = False,
    quick: bool = False,
) -> list[ConformanceReport]:
    """Check every implementation a registry holds whose predicates accept ``device`` and each dtype.

    Args:
        registry: a ``KernelRegistry``.
        ignore_predicates: check implementations even where their predicates refuse (Triton kernels on CPU
            under ``TRITON_INTERPRET=1``).
        names: limit to these kernel names; names without cases are skipped.
    """
    from plyx.specs.kernels import KernelQuery

    cc = None
    if device.startswith("cuda"):  # predicates on compute capability need the real one
        cc = tuple(_torch().cuda.get_device_capability(device))
    reports = []
    for name in names or registry.names():
        if name not in KERNEL_CASES:
            continue
        for impl in registry.implementations(name):
            accepted = [d for d in dtypes if ignore_predicates or impl.capability.refusal(
                KernelQuery(device_type=device.split(":")[0], dtype=d, compute_capability=cc,
                            requires_grad=impl.capability.backward)) is None]
            if accepted:
                reports.append(check_kernel(name, impl.fn, impl=impl.impl, device=device, dtypes=accepted,
                                            grad=impl.capability.backward, quick=quick))
    return reports
