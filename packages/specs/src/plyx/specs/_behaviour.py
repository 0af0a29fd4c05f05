"""Behaviour vectors: what a contract's own code answers, frozen with its surface.

A signature can stay the same while the meaning changes ("capability refusal
ignores dtypes"). Each contract here has a fixed table of probes, each answered
by the contract's code with a small JSON value (accepted or not, the bound
sizes, the error class); ``plyx contracts snapshot`` freezes the answers next
to the surface and ``check`` fails when one changes. Answers are outcomes, not
message text, so rewording an error is not a break.

No torch: tensors are stand-ins with ``.shape`` and ``.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["behaviour", "PROBES"]


class _Tensor:
    """A stand-in for a tensor: what TensorSpec reads (shape, dtype, contiguity)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, contiguous: bool = True) -> None:
        self.shape, self.dtype, self._contiguous = shape, dtype, contiguous

    def is_contiguous(self) -> bool:
        return self._contiguous


def _outcome(fn: Callable[[], Any]) -> Any:
    """The probe's answer, or the class of the error it raised (``"raises TensorSpecError"``)."""
    try:
        return fn()
    except Exception as exc:  # the outcome of any error is recorded, not its text
        return f"raises {type(exc).__name__}"


def _kernels() -> dict[str, Any]:
    from plyx.specs.kernels import Capability, KernelQuery

    caps = {
        "any": Capability(),
        "cuda-bf16-sm80": Capability(devices={"cuda"}, dtypes={"bfloat16", "float16"}, min_compute_capability=(8, 0)),
        "max-sm89": Capability(max_compute_capability=(8, 9)),
        "forward-only": Capability(backward=False),
        "hidden<=8192": Capability(shape_limits={"hidden": (64, 8192)}),
        "head_dim%16": Capability(shape_multiple_of={"head_dim": 16}),
        "head_dim-in-64-128": Capability(shape_in={"head_dim": frozenset({64, 128})}),
        "requires-missing": Capability(requires=("plyx_no_such_module_for_probes",)),
        "check-refuses-odd": Capability(check=lambda q: "odd" if q.shape.get("hidden", 0) % 2 else None),
    }
    queries = {
        "cpu-f32": KernelQuery("cpu", "float32"),
        "cuda-bf16-sm90": KernelQuery("cuda", "bfloat16", (9, 0)),
        "cuda-f32-sm90": KernelQuery("cuda", "float32", (9, 0)),
        "cuda-f16-sm75": KernelQuery("cuda", "float16", (7, 5)),
        "cuda-bf16-nocc": KernelQuery("cuda", "bfloat16", None),
        "grad": KernelQuery("cpu", "float32", requires_grad=True),
        "hidden=32": KernelQuery("cpu", "float32", shape={"hidden": 32}),
        "hidden=8192": KernelQuery("cpu", "float32", shape={"hidden": 8192}),
        "hidden=8193": KernelQuery("cpu", "float32", shape={"hidden": 8193}),
        "head_dim=96": KernelQuery("cpu", "float32", shape={"head_dim": 96}),
        "head_dim=128": KernelQuery("cpu", "float32", shape={"head_dim": 128}),
        "head_dim=40": KernelQuery("cpu", "float32", shape={"head_dim": 40}),
    }
    out: dict[str, Any] = {}
    for cname, cap in caps.items():
        for qname, query in queries.items():
            out[f"Capability[{cname}].refusal({qname}) accepts"] = _outcome(lambda c=cap, q=query: c.refusal(q) is None)
    for qname in ("hidden=8193", "head_dim=40", "cuda-bf16-sm90"):
        out[f"KernelQuery({qname}).shape_class"] = [list(p) for p in queries[qname].shape_class()]
    return out


def _tensorspec() -> dict[str, Any]:
    from plyx.specs.tensorspec import TensorSpec, bind, dtype_name

    q = TensorSpec(("B", "T", "H", "Dh"), dtype=("bfloat16", "float16"))
    mask = TensorSpec(("B", "T"), dtype="bool")
    tail = TensorSpec(("...", "D"), dtype="float32", layout="contiguous")
    fixed = TensorSpec((None, 8))
    cases: dict[str, Callable[[], Any]] = {
        "q bf16 [2,5,4,8]": lambda: q.validate(_Tensor((2, 5, 4, 8), "bfloat16")),
        "q float32": lambda: q.validate(_Tensor((2, 5, 4, 8), "float32")),
        "q rank 3": lambda: q.validate(_Tensor((2, 5, 4), "bfloat16")),
        "bind q + mask agree": lambda: bind(q=(q, _Tensor((2, 5, 4, 8), "float16")), mask=(mask, _Tensor((2, 5), "bool"))),
        "bind q + mask disagree on T": lambda: bind(q=(q, _Tensor((2, 5, 4, 8), "float16")),
                                                   mask=(mask, _Tensor((2, 6), "bool"))),
        "bind skips None": lambda: bind(q=(q, _Tensor((1, 3, 2, 4), "bfloat16")), mask=(mask, None)),
        "... [3,4,7]": lambda: tail.validate(_Tensor((3, 4, 7), "float32")),
        "... [] rank 0": lambda: tail.validate(_Tensor((), "float32")),
        "... non-contiguous": lambda: tail.validate(_Tensor((3, 7), "float32", contiguous=False)),
        "fixed [5, 8]": lambda: fixed.validate(_Tensor((5, 8), "int8")),
        "fixed [5, 9]": lambda: fixed.validate(_Tensor((5, 9), "int8")),
        "not a tensor": lambda: q.validate(object()),
        "dtype_name aliases": lambda: [dtype_name(d) for d in ("bf16", "torch.float16", "fp32", "long", "double")],
    }
    return {name: _outcome(fn) for name, fn in cases.items()}


def _batch() -> dict[str, Any]:
    from plyx.specs.batch import BATCH_SPECS

    shapes = {"[2, 3] int64": ((2, 3), "int64"), "[2, 3] float32": ((2, 3), "float32"), "[6] int64": ((6,), "int64")}
    return {f"BATCH_SPECS[{name}] accepts {label}": _outcome(lambda s=spec, v=value: bool(s.validate(_Tensor(*v))))
            for name, spec in BATCH_SPECS.items() for label, value in shapes.items()}


def _config() -> dict[str, Any]:
    from plyx.specs.config import KernelConfig, ModelConfig

    cases: dict[str, Callable[[], Any]] = {
        "ModelConfig defaults load": lambda: bool(ModelConfig.from_dict({})),
        "ModelConfig unknown field": lambda: ModelConfig.from_dict({"n_layerz": 2}),
        "ModelConfig n_heads must divide d_model": lambda: ModelConfig.from_dict({"d_model": 512, "n_heads": 6}),
        "KernelConfig.parse_env": lambda: KernelConfig.parse_env("rmsnorm=reference, rope=triton"),
        "KernelConfig.parse_env malformed": lambda: KernelConfig.parse_env("rmsnorm"),
    }
    return {name: _outcome(fn) for name, fn in cases.items()}


#: contract -> the function that answers its probes (contracts without probes answer {})
PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "kernels": _kernels,
    "tensorspec": _tensorspec,
    "batch": _batch,
    "config": _config,
}


def behaviour(contract: str) -> dict[str, Any]:
    """The answers of ``contract``'s probes now (JSON-able), ``{}`` for a contract without probes."""
    probes = PROBES.get(contract)
    return probes() if probes is not None else {}
