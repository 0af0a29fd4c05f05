"""Conformance of a plugin object: known hooks, valid signatures, well-formed answers.

Example (in a third party's test suite)::

    from plyx.specs.testing.plugins import check_plugin
    import my_plyx_plugin

    def test_conforms():
        check_plugin(my_plyx_plugin)
"""

from __future__ import annotations

import inspect
from typing import Any

from plyx.specs import hookspecs
from plyx.specs.components import CliCommand, Component
from plyx.specs.plugins import _check_contracts, contract_versions

__all__ = ["check_plugin", "LIST_HOOKS"]

#: list hooks and the type of each item they must return
LIST_HOOKS: dict[str, type] = {
    "plyx_kv_cache_kinds": Component,
    "plyx_samplers": Component,
    "plyx_optimizers": Component,
    "plyx_exporters": Component,
    "plyx_guardrails": Component,
    "plyx_redteam_probes": Component,
    "plyx_adapter_variants": Component,
    "plyx_tool_parsers": Component,
    "plyx_reward_functions": Component,
    "plyx_cli_commands": CliCommand,
}


def check_plugin(plugin: Any) -> list[str]:
    """Raise ``AssertionError`` listing every problem; return the hooks it implements.

    Checks: the declared ``plyx_contracts`` are compatible with this plyx-specs;
    every ``plyx_*`` function is a known hook; its parameters are a subset of the
    hook spec's; list hooks return lists of the documented item type with
    unique names.
    """
    problems: list[str] = []
    reason = _check_contracts(getattr(plugin, "plyx_contracts", None), contract_versions())
    if reason:
        problems.append(reason)
    implemented = []
    for name in sorted(n for n in dir(plugin) if n.startswith("plyx_") and n != "plyx_contracts"):
        impl = getattr(plugin, name)
        if not callable(impl):
            continue
        spec = getattr(hookspecs, name, None)
        if spec is None:
            problems.append(f"{name}: not a plyx hook (see plyx.specs.hookspecs)")
            continue
        implemented.append(name)
        wanted = set(inspect.signature(spec).parameters)
        extra = [p for p in inspect.signature(impl).parameters if p not in wanted]
        if extra:
            problems.append(f"{name}: parameters {extra} are not in the hook spec {sorted(wanted)}")
            continue
        if name in LIST_HOOKS and not inspect.signature(impl).parameters:
            result = impl()
            item_type = LIST_HOOKS[name]
            if not isinstance(result, list):
                problems.append(f"{name}: must return a list of {item_type.__name__}, got {type(result).__name__}")
                continue
            names = [getattr(item, "name", None) for item in result]
            for item in result:
                if not isinstance(item, item_type):
                    problems.append(f"{name}: item {item!r} is not a {item_type.__name__}")
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                problems.append(f"{name}: duplicate names {duplicates}")
    if problems:
        raise AssertionError("plugin does not conform:\n  - " + "\n  - ".join(problems))
    return implemented
