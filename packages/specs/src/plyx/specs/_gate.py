"""The behavioural half of the contract gate: every discovered implementation through its conformance kit.

``plyx contracts check --conformance`` runs, after the surface and behaviour
checks, the kits shipped in ``plyx.specs.testing`` over whatever the installed
distributions register, the same way for plyx's own planes and third parties:

- every loaded plugin through ``check_plugin`` (hook names, signatures, answers);
- every KV-cache kind (``plyx_kv_cache_kinds``) through ``check_kvcache``;
- every kernel implementation (``plyx_register_kernels`` and
  ``plyx_register_attention_backends``, collected without importing the
  registry's distribution) with conformance cases, on every case, forward and
  backward, where its predicates accept the device (Triton kernels on CPU run
  their first case under ``TRITON_INTERPRET=1``).

A change to a contract's meaning that some implementation relies on fails
here, in the gate, not only later in that implementation's plane.

Each kit is the one written for a major version of its contract (``KITS``):
bumping a contract's major without a kit for the new version fails the gate,
so implementations are never checked against a kit of another version.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["run_conformance", "collect_kernels", "KITS"]

#: contract -> the majors its conformance kit (in plyx.specs.testing) was written for
KITS: dict[str, tuple[int, ...]] = {"hooks": (1,), "kvcache": (1,), "kernels": (1,)}


def _kit_version_problems() -> list[str]:
    from plyx.specs.plugins import contract_versions

    provided = contract_versions()
    return [f"no conformance kit for the {name} contract v{provided[name]} (kits exist for major(s) "
            f"{', '.join(map(str, majors))}): write one in plyx.specs.testing and add it to KITS"
            for name, majors in KITS.items() if int(provided[name].split(".")[0]) not in majors]


class _Collector:
    """A registry stand-in that only records what the registration hooks register."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.impls: list[Any] = []

    def register(self, impl: Any, *, source: str = "") -> None:  # source: ignored, the distribution is known
        import attrs

        self.impls.append(attrs.evolve(impl, source=self.source))


def collect_kernels() -> list[Any]:
    """Every ``KernelImpl`` the loaded plugins register, attributed to their distribution."""
    from plyx.specs import plugins

    pm = plugins.get_plugin_manager()
    found: list[Any] = []
    for hook in ("plyx_register_kernels", "plyx_register_attention_backends"):
        for impl in getattr(pm.hook, hook).get_hookimpls():
            collector = _Collector(plugins.source_of(impl.plugin_name))
            impl.function(registry=collector)
            found += collector.impls
    return found


def _kernel_checks(device: str) -> list[tuple[str, Callable[[], list[str]]]]:
    from plyx.specs.kernels import KernelQuery
    from plyx.specs.testing.kernels import KERNEL_CASES, check_kernel

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    checks = []
    for impl in collect_kernels():
        if impl.name not in KERNEL_CASES:
            continue
        accepts = impl.capability.refusal(KernelQuery(device_type=device, dtype="float32")) is None
        interpretable = interpret and "triton" in impl.capability.requires and device == "cpu"
        if not accepts and not interpretable:
            continue

        def run(impl: Any = impl, quick: bool = not accepts) -> list[str]:
            report = check_kernel(impl.name, impl.fn, impl=impl.impl, device=device, dtypes=("float32",),
                                  grad=impl.capability.backward, quick=quick)
            return list(report.failures)

        checks.append((f"kernel {impl.qualname} ({impl.source})", run))
    return checks


def _cache_checks() -> list[tuple[str, Callable[[], list[str]]]]:
    from plyx.specs.plugins import components
    from plyx.specs.testing.kvcache import check_kvcache

    def run(factory: Any) -> list[str]:
        try:
            check_kvcache(factory)
        except AssertionError as exc:
            return [str(exc)]
        return []

    return [(f"kv cache {name} ({c.source})", lambda c=c: run(c.factory))
            for name, c in sorted(components("plyx_kv_cache_kinds").items())]


def _plugin_checks() -> list[tuple[str, Callable[[], list[str]]]]:
    from plyx.specs.plugins import get_plugin_manager, plugin_report
    from plyx.specs.testing.plugins import check_plugin

    pm = get_plugin_manager()

    def run(name: str) -> list[str]:
        try:
            check_plugin(pm.get_plugin(name))
        except AssertionError as exc:
            return [str(exc)]
        return []

    return [(f"plugin {r.name} ({r.distribution} {r.version})", lambda n=r.name: run(n))
            for r in plugin_report() if r.status == "loaded"]


def run_conformance(*, device: str = "cpu", echo: Callable[[str], None] = print) -> int:
    """Run every kit on every discovered implementation; print one line each. Returns 0 when all pass, else 1."""
    failed = 0
    total = 0
    kit_problems = _kit_version_problems()
    for problem in kit_problems:
        echo(f"FAIL {problem}")
    for group in (_plugin_checks, _cache_checks, lambda: _kernel_checks(device)):
        for label, check in group():
            total += 1
            try:
                failures = check()
            except Exception as exc:  # an implementation may fail in any way; the gate reports it
                failures = [f"raised {type(exc).__name__}: {exc}"]
            echo(f"{'ok  ' if not failures else 'FAIL'} {label}")
            for line in failures:
                echo(f"  - {line}")
            failed += bool(failures)
    echo(f"conformance: {total - failed}/{total} implementation(s) pass" + ("" if total else " (none discovered)")
         + (f"; {len(kit_problems)} contract(s) without a kit for their version" if kit_problems else ""))
    return 1 if failed or kit_problems else 0
