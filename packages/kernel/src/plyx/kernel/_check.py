"""``plyx kernels check [DIST|MODULE]``: the conformance kit as one command a kernel author runs on a plugin.

The target is an installed distribution (its ``plyx`` entry points), an
importable module (a plugin not installed yet), or nothing (every
implementation the default registry holds). Each implementation with
conformance cases runs every case inside its declared capability, forward and
backward, in each dtype, on the device; the report has one line per kernel,
dtype, device and direction.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import attrs
from plyx.kernel._default import _HOOKS, _Attributed, registry
from plyx.kernel._registry import Registry, query_for
from plyx.specs.kernels import KernelImpl, KernelQuery
from plyx.specs.testing.kernels import KERNEL_CASES, UNIT_ROUNDOFF, CaseResult, check_kernel

__all__ = ["check_target", "implementations_of", "CheckedImpl"]

_DEFAULT_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}


@attrs.frozen
class CheckedImpl:
    """One implementation's verdict: ``results`` per case, dtype and direction; ``note`` when nothing ran."""

    impl: KernelImpl
    results: tuple[CaseResult, ...]
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.note.startswith("error") and all(r.status != "fail" for r in self.results)


def _plugins_of(target: str) -> tuple[list[tuple[object, str]], str]:
    """(plugin objects with their source, what the target turned out to be)."""
    try:
        from importlib import metadata

        dist = metadata.distribution(target)
    except Exception:  # not an installed distribution: try it as a module
        dist = None
    if dist is not None:
        eps = [ep for ep in dist.entry_points if ep.group == "plyx"]
        if not eps:
            raise LookupError(f"distribution {target!r} has no entry point in the `plyx` group; add "
                              f'[project.entry-points.plyx] my_plugin = "my_package.plyx_plugin" to its pyproject')
        source = f"{dist.metadata['Name']} {dist.version}"
        return [(ep.load(), source) for ep in eps], f"distribution {source}"
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        raise LookupError(f"{target!r} is neither an installed distribution nor an importable module ({exc}); "
                          f"pass a distribution name (`pip show` lists it) or a module path like my_pkg.plyx_plugin"
                          ) from exc
    return [(module, f"module {target}")], f"module {target}"


def implementations_of(target: str | None) -> tuple[list[KernelImpl], str]:
    """The kernel implementations ``target`` registers (all of the default registry's for None)."""
    if target is None:
        return list(registry()), "every registered implementation"
    found = Registry(verify=False)
    plugins, what = _plugins_of(target)
    for plugin, source in plugins:
        for hook in _HOOKS:
            fn = getattr(plugin, hook, None)
            if callable(fn):
                fn(registry=_Attributed(found, source))
    if not found.names():
        raise LookupError(f"{what} registers no kernel implementation (no plyx_register_kernels or "
                          f"plyx_register_attention_backends hook)")
    return list(found), what


def _check_one(impl: KernelImpl, device: str, dtypes: Iterable[str]) -> CheckedImpl:
    if impl.name not in KERNEL_CASES:
        return CheckedImpl(impl, (), f"error: kernel {impl.name!r} has no conformance cases; a plugin that "
                                     f"introduces a name gives it cases with plyx.specs.testing.kernels.add_cases")
    accepted = [d for d in dtypes if d in UNIT_ROUNDOFF
                and impl.capability.refusal(KernelQuery(device_type=device, dtype=d)) is None]
    if not accepted:
        return CheckedImpl(impl, (), f"skipped: its capability refuses {device} in {', '.join(dtypes)}")
    results: list[CaseResult] = []
    for dtype in accepted:
        def inside(args: list[Any], kwargs: dict[str, Any], dtype: str = dtype) -> str | None:
            sized = query_for(impl.name, *[a for a in args if hasattr(a, "shape")])
            return impl.capability.refusal(KernelQuery(device_type=device, dtype=dtype,
                                                       compute_capability=sized.compute_capability,
                                                       shape=sized.shape, requires_grad=impl.capability.backward))

        report = check_kernel(impl.name, impl.fn, impl=impl.impl, device=device, dtypes=(dtype,),
                              grad=impl.capability.backward, case_filter=inside)
        results += report.results
    if not any(r.status != "skip" for r in results):
        return CheckedImpl(impl, tuple(results), "error: no conformance case lies inside its declared capability")
    return CheckedImpl(impl, tuple(results))


def check_target(target: str | None, *, device: str = "cpu", dtypes: Iterable[str] | None = None,
                 names: Iterable[str] | None = None) -> tuple[list[CheckedImpl], str]:
    """Check every implementation ``target`` registers on ``device`` in ``dtypes``.

    Args:
        target: a distribution name, a module path, or None for the default registry.
        device: ``cpu`` or ``cuda``.
        dtypes: dtype names (default: float32 and bfloat16 on CPU, plus float16 on CUDA).
        names: only these kernel names.

    Returns:
        (one ``CheckedImpl`` per implementation, a description of the target).
    """
    impls, what = implementations_of(target)
    wanted = set(names or ())
    chosen = tuple(dtypes or _DEFAULT_DTYPES.get(device, ("float32",)))
    return [_check_one(i, device, chosen) for i in impls if not wanted or i.name in wanted], what
