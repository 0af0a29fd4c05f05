"""The plugin manager: one ``plyx`` entry-point group, scanned once per process, lazily.

Importing ``plyx.specs`` scans nothing; the first call of
``get_plugin_manager()`` (or of anything that needs plugins) does, under a lock,
and the result is cached for the process. A spawned worker or torchrun rank
imports fresh and scans again on first use, so registration happens in every
process.

Environment:
    PLYX_PLUGINS: comma-separated allowlist of entry-point or distribution names;
        when set, nothing else is loaded.
    PLYX_DISABLE_PLUGIN_AUTOLOAD: when set (non-empty, not "0"), no entry point is
        loaded; plugins can still be registered by hand with ``register_plugin``.
    PLYX_STRICT_PLUGINS: when set, a broken or incompatible plugin raises instead
        of being skipped with a warning.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import pluggy
from plyx.specs import hookspecs
from plyx.specs.components import CliCommand, Component
from plyx.specs.errors import IncompatiblePluginError, PluginConflictError, PluginError

try:  # the backport keeps one API from 3.10 to 3.13
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginRecord",
    "PluginWarning",
    "components",
    "contract_versions",
    "get_plugin_manager",
    "plugin_report",
    "register_plugin",
    "reset_plugins",
    "cli_commands",
]

ENTRY_POINT_GROUP = "plyx"


class PluginWarning(UserWarning):
    """A plugin was skipped; the message names its distribution and the reason."""


@attrs.frozen
class PluginRecord:
    """What the loader did with one plugin.

    Attributes:
        name: the entry-point name.
        distribution: distribution name; ``version`` its version.
        value: ``module:attr`` the entry point points at.
        status: loaded | skipped (broken or incompatible) | filtered (not in
            PLYX_PLUGINS) | disabled (PLYX_DISABLE_PLUGIN_AUTOLOAD).
        reason: why it was not loaded ("" when loaded).
        contracts: the contract versions it declared.
    """

    name: str
    distribution: str
    version: str
    value: str
    status: Literal["loaded", "skipped", "filtered", "disabled"]
    reason: str = ""
    contracts: Mapping[str, str] = attrs.field(factory=dict)


def contract_versions() -> dict[str, str]:
    """The contract versions this plyx-specs provides, by contract name."""
    import importlib

    batch, checkpoint, kernels, kvcache, tensorspec = (
        importlib.import_module(f"plyx.specs.{n}") for n in ("batch", "checkpoint", "kernels", "kvcache", "tensorspec")
    )
    return {
        "hooks": hookspecs.CONTRACT_VERSION,
        "kernels": kernels.CONTRACT_VERSION,
        "kvcache": kvcache.CONTRACT_VERSION,
        "checkpoint": checkpoint.CONTRACT_VERSION,
        "batch": batch.CONTRACT_VERSION,
        "tensorspec": tensorspec.CONTRACT_VERSION,
        "config": "1.0",
    }


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pm: pluggy.PluginManager | None = None
        self.records: list[PluginRecord] = []
        self.sources: dict[str, str] = {}  # plugin name -> "dist version"


_STATE = _State()


def _truthy(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "False", "no")


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _check_contracts(declared: Any, provided: Mapping[str, str]) -> str | None:
    """None when compatible, else the reason (same major, minor not newer than ours)."""
    if declared is None:
        return None
    if not isinstance(declared, Mapping):
        return f"plyx_contracts must be a dict like {{'hooks': '1.0'}}, got {type(declared).__name__}"
    for contract, version in declared.items():
        ours = provided.get(contract)
        if ours is None:
            return f"declares contract {contract!r}, which this plyx-specs does not provide ({', '.join(provided)})"
        try:
            want_major, want_minor = (int(x) for x in str(version).split(".")[:2])
            have_major, have_minor = (int(x) for x in ours.split(".")[:2])
        except ValueError:
            return f"contract {contract!r} version {version!r} is not MAJOR.MINOR"
        if want_major != have_major:
            return (
                f"needs {contract} contract {version}, this plyx-specs provides {ours} "
                f"(major versions differ; install a plyx-specs {want_major}.x or a build of the plugin for {ours})"
            )
        if want_minor > have_minor:
            return f"needs {contract} contract {version}, this plyx-specs provides {ours}; upgrade plyx-specs"
    return None


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    names = [n for n in dir(plugin) if n.startswith("plyx_") and n != "plyx_contracts"]
    return [n for n in names if callable(getattr(plugin, n, None)) and not hasattr(pm.hook, n)]


def _fail(strict: bool, error: PluginError) -> None:
    if strict:
        raise error
    warnings.warn(f"{error}; skipped (set PLYX_STRICT_PLUGINS=1 to raise)", PluginWarning, stacklevel=4)


def _register(
    pm: pluggy.PluginManager, plugin: object, name: str, source: str, strict: bool
) -> tuple[bool, str, dict[str, str]]:
    declared = getattr(plugin, "plyx_contracts", None)
    contracts = dict(declared) if isinstance(declared, Mapping) else {}
    reason = _check_contracts(declared, contract_versions())
    if reason:
        _fail(strict, IncompatiblePluginError(name, source, reason))
        return False, reason, contracts
    unknown = _unknown_hooks(pm, plugin)
    if unknown:
        reason = f"implements unknown hook(s) {', '.join(unknown)}; see plyx.specs.hookspecs for the hook names"
        _fail(strict, PluginError(name, source, reason))
        return False, reason, contracts
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        reason = f"rejected at registration: {exc}"
        _fail(strict, PluginError(name, source, reason))
        return False, reason, contracts
    return True, "", contracts


def _dist_label(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", ""
    return dist.metadata["Name"] or dist.name, dist.version


def _scan(pm: pluggy.PluginManager, strict: bool) -> list[PluginRecord]:
    records: list[PluginRecord] = []
    disabled = _truthy("PLYX_DISABLE_PLUGIN_AUTOLOAD")
    allow = {s.strip() for s in os.environ.get("PLYX_PLUGINS", "").split(",") if s.strip()}
    seen: dict[str, tuple[str, str]] = {}  # name -> (distribution, value)
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        dist, version = _dist_label(ep)
        if ep.name in seen:
            first_dist, first_value = seen[ep.name]
            if (first_dist, first_value) == (dist, ep.value):
                continue  # the same distribution seen twice on sys.path
            raise PluginConflictError(ep.name, first_dist, f"{dist} {version}".strip())
        seen[ep.name] = (dist, ep.value)
        source = f"{dist} {version}".strip()
        if disabled:
            records.append(PluginRecord(ep.name, dist, version, ep.value, "disabled", "PLYX_DISABLE_PLUGIN_AUTOLOAD is set"))
            continue
        if allow and ep.name not in allow and dist not in allow:
            records.append(PluginRecord(ep.name, dist, version, ep.value, "filtered", "not listed in PLYX_PLUGINS"))
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a plugin's import may fail in any way
            reason = f"failed to import {ep.value}: {type(exc).__name__}: {exc}"
            _fail(strict, PluginError(ep.name, source, reason))
            records.append(PluginRecord(ep.name, dist, version, ep.value, "skipped", reason))
            continue
        ok, reason, contracts = _register(pm, plugin, ep.name, source, strict)
        status: Literal["loaded", "skipped"] = "loaded" if ok else "skipped"
        records.append(PluginRecord(ep.name, dist, version, ep.value, status, reason, contracts))
        if ok:
            _STATE.sources[ep.name] = source
    return records


def get_plugin_manager(*, strict: bool | None = None) -> pluggy.PluginManager:
    """The process's plugin manager, scanning entry points on the first call.

    Args:
        strict: raise on broken or incompatible plugins instead of warning;
            defaults to the ``PLYX_STRICT_PLUGINS`` environment variable.
    """
    if _STATE.pm is not None:
        return _STATE.pm
    with _STATE.lock:
        if _STATE.pm is None:
            pm = _new_manager()
            strict_mode = _truthy("PLYX_STRICT_PLUGINS") if strict is None else strict
            _STATE.records = _scan(pm, strict_mode)
            _STATE.pm = pm
    return _STATE.pm


def plugin_report() -> list[PluginRecord]:
    """What the scan found, loaded and skipped (scans first if needed)."""
    get_plugin_manager()
    return list(_STATE.records)


def register_plugin(plugin: object, name: str, *, distribution: str = "<in-process>") -> None:
    """Register an object as a plugin by hand (tests, notebooks, applications).

    Contract declarations and hook names are checked as for entry points; an
    incompatible plugin raises.
    """
    pm = get_plugin_manager()
    with _STATE.lock:
        if pm.has_plugin(name):
            raise PluginConflictError(name, _STATE.sources.get(name, "?"), distribution)
        ok, reason, contracts = _register(pm, plugin, name, distribution, strict=True)
        _STATE.sources[name] = distribution
        _STATE.records.append(PluginRecord(name, distribution, "", repr(plugin), "loaded", "", contracts))


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered by hand."""
    pm = get_plugin_manager()
    with _STATE.lock:
        pm.unregister(name=name)
        _STATE.sources.pop(name, None)
        _STATE.records = [r for r in _STATE.records if r.name != name]


def reset_plugins() -> None:
    """Forget the scan; the next use scans again (tests, or after installing a plugin)."""
    with _STATE.lock:
        _STATE.pm = None
        _STATE.records = []
        _STATE.sources = {}


def source_of(plugin_name: str) -> str:
    """``distribution version`` of a loaded plugin."""
    return _STATE.sources.get(plugin_name, plugin_name)


def _collect(hook_name: str) -> Iterable[tuple[str, Any]]:
    pm = get_plugin_manager()
    caller = getattr(pm.hook, hook_name)
    # call each implementation separately so every result can be attributed
    for impl in reversed(caller.get_hookimpls()):
        result = impl.function()
        for item in result or ():
            yield impl.plugin_name, item


def components(hook_name: str) -> dict[str, Component]:
    """Components returned by a list hook (``plyx_samplers``...), by name.

    Raises:
        PluginConflictError: two plugins return a component with the same name.
    """
    found: dict[str, Component] = {}
    for plugin_name, item in _collect(hook_name):
        if not isinstance(item, Component):
            raise PluginError(plugin_name, source_of(plugin_name), f"{hook_name} returned {item!r}, not a Component")
        if item.name in found:
            raise PluginConflictError(item.name, found[item.name].source, source_of(plugin_name))
        found[item.name] = attrs.evolve(item, source=source_of(plugin_name))
    return found


def cli_commands() -> dict[str, CliCommand]:
    """Subcommands contributed through ``plyx_cli_commands``, by name."""
    found: dict[str, tuple[CliCommand, str]] = {}
    for plugin_name, item in _collect("plyx_cli_commands"):
        if item.name in found:
            raise PluginConflictError(f"plyx {item.name}", found[item.name][1], source_of(plugin_name))
        found[item.name] = (item, source_of(plugin_name))
    return {name: cmd for name, (cmd, _) in found.items()}
