"""The plugin manager: one ``plyx`` entry-point group, scanned once per process, lazily.

Importing ``plyx.specs`` scans nothing; the first call of
``get_plugin_manager()`` (or of anything that needs plugins) does, under a lock,
and the result is cached for the process. A spawned worker or torchrun rank
imports fresh and scans again on first use, so registration happens in every
process.

Environment:
    PLYX_PLUGINS: comma-separated allowlist of entry-point or distribution names;
        when set, nothing else is loaded; a name that matches nothing is warned about.
    PLYX_DISABLE_PLUGIN_AUTOLOAD: when set (non-empty, not "0"), no entry point is
        loaded; plugins can still be registered by hand with ``register_plugin``.
    PLYX_STRICT_PLUGINS: when set, a broken or incompatible plugin raises instead
        of being skipped with a warning.

Failures are contained: a plugin that fails to import, declares an
incompatible contract, implements an unknown hook, shares its name with
another distribution's plugin, or whose hook raises is skipped (both, for a
name conflict) with a ``PluginWarning`` that names its distribution and points
at the plugin's code (or, for conflicts and allowlist problems, at the caller);
the rest keeps working. Strict mode raises instead.
"""

from __future__ import annotations

import os
import sys
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
    """The contract versions this plyx-specs provides, by contract name (imports no contract module)."""
    from plyx.specs._versions import CONTRACT_VERSIONS

    return dict(CONTRACT_VERSIONS)


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


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.sep + "pluggy" + os.sep,
             os.sep + "importlib" + os.sep, os.sep + "importlib_metadata" + os.sep, "<frozen ")


#: any plyx plane's own files: a warning about the scan points past them, at the code that called plyx
_PLYX_DIR = os.sep + "plyx" + os.sep


def _outside_plyx_specs() -> tuple[str, int, dict[str, Any] | None]:
    """File, line and globals of the innermost caller outside plyx (any plane), pluggy and importlib."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in (*_INTERNAL, _PLYX_DIR)) and not name.startswith("<"):
            return name, frame.f_lineno, frame.f_globals
        frame = frame.f_back  # type: ignore[assignment]
    return "<plyx>", 0, None


def _where(plugin: object | None = None, exc: BaseException | None = None) -> tuple[str, int, dict[str, Any] | None]:
    """Where a plugin warning should point: the failing line of the plugin's code, its module, or the caller."""
    tb = exc.__traceback__ if exc is not None else None
    last = None
    while tb is not None:  # the innermost frame that is not plyx.specs/pluggy/importlib: the plugin's own line
        name = tb.tb_frame.f_code.co_filename
        if not any(part in name for part in _INTERNAL):
            last = (name, tb.tb_lineno, tb.tb_frame.f_globals)
        tb = tb.tb_next
    if last is not None:
        return last
    if exc is not None and isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 1, None
    module = sys.modules.get(getattr(plugin, "__module__", "") or "") if plugin is not None else None
    if plugin is not None and hasattr(plugin, "__file__"):
        module = plugin  # a plugin module
    path = getattr(module, "__file__", None)
    if path:
        return path, 1, vars(module)
    return _outside_plyx_specs()


def warn_at(message: str, where: tuple[str, int, dict[str, Any] | None],
            category: type[Warning] | None = None) -> None:
    """Warn as if from ``where`` (file, line, module globals): the plugin's code or the user's, never plyx.specs."""
    filename, lineno, module_globals = where
    module = (module_globals or {}).get("__name__", os.path.splitext(os.path.basename(filename))[0])
    registry = (module_globals or {}).setdefault("__warningregistry__", {}) if module_globals is not None else None
    warnings.warn_explicit(message, category or PluginWarning, filename, lineno, module=module, registry=registry,
                           module_globals=module_globals)


def _fail(strict: bool, error: PluginError, *, plugin: object | None = None, exc: BaseException | None = None) -> None:
    if strict:
        if exc is not None:
            raise error from exc
        raise error
    warn_at(f"{error}; skipped (set PLYX_STRICT_PLUGINS=1 to raise)", _where(plugin, exc))


def _register(
    pm: pluggy.PluginManager, plugin: object, name: str, source: str, strict: bool
) -> tuple[bool, str, dict[str, str]]:
    declared = getattr(plugin, "plyx_contracts", None)
    contracts = dict(declared) if isinstance(declared, Mapping) else {}
    reason = _check_contracts(declared, contract_versions())
    if reason:
        _fail(strict, IncompatiblePluginError(name, source, reason), plugin=plugin)
        return False, reason, contracts
    unknown = _unknown_hooks(pm, plugin)
    if unknown:
        reason = f"implements unknown hook(s) {', '.join(unknown)}; see plyx.specs.hookspecs for the hook names"
        _fail(strict, PluginError(name, source, reason), plugin=plugin)
        return False, reason, contracts
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        reason = f"rejected at registration: {exc}"
        _fail(strict, PluginError(name, source, reason), plugin=plugin)
        return False, reason, contracts
    return True, "", contracts


def _dist_label(ep: Any, cache: dict[Any, tuple[str, str]] | None = None) -> tuple[str, str]:
    """(name, version) of the distribution an entry point comes from; ``cache`` saves re-parsing its METADATA."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", ""
    key = getattr(dist, "_path", None) or id(dist)
    if cache is not None and key in cache:
        return cache[key]
    meta = dist.metadata  # parses METADATA: once per distribution
    label = (meta["Name"] or dist.name, meta["Version"] or dist.version)
    if cache is not None:
        cache[key] = label
    return label


def _scan(pm: pluggy.PluginManager, strict: bool) -> list[PluginRecord]:
    records: list[PluginRecord] = []
    disabled = _truthy("PLYX_DISABLE_PLUGIN_AUTOLOAD")
    allow = {s.strip() for s in os.environ.get("PLYX_PLUGINS", "").split(",") if s.strip()}
    # one entry per (name, distribution, value): the same distribution seen twice on sys.path counts once
    by_name: dict[str, dict[tuple[str, str], Any]] = {}
    cache: dict[Any, tuple[str, str]] = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        dist, _ = _dist_label(ep, cache)
        by_name.setdefault(ep.name, {}).setdefault((dist, ep.value), ep)
    matched: set[str] = set()
    for name, variants in by_name.items():
        eps = list(variants.values())
        labels = [_dist_label(ep, cache) for ep in eps]
        matched.update(n for n in [name, *(d for d, _ in labels)] if n in allow)
        if len(eps) > 1 and allow and name not in allow:
            # the allowlist names distributions: it may pick one side of the conflict
            picked = [ep for ep, (d, _) in zip(eps, labels) if d in allow]
            if len(picked) == 1:
                for ep, (d, v) in zip(eps, labels):
                    if ep is not picked[0]:
                        records.append(PluginRecord(name, d, v, ep.value, "filtered", "not listed in PLYX_PLUGINS"))
                eps, labels = picked, [_dist_label(picked[0], cache)]
        if len(eps) > 1:
            both = [f"{d} {v}".strip() for d, v in labels]
            if disabled:
                records += [PluginRecord(name, d, v, ep.value, "disabled", "PLYX_DISABLE_PLUGIN_AUTOLOAD is set")
                            for ep, (d, v) in zip(eps, labels)]
                continue
            error = PluginConflictError(name, both[0], both[1])
            if strict:
                raise error
            reason = (f"conflict: plugin name {name!r} is registered by {' and by '.join(both)}; both are skipped "
                      f"(uninstall one, or name one distribution in PLYX_PLUGINS)")
            warn_at(f"{reason} (set PLYX_STRICT_PLUGINS=1 to raise)", _outside_plyx_specs())
            records += [PluginRecord(name, d, v, ep.value, "skipped", reason) for ep, (d, v) in zip(eps, labels)]
            continue
        records.append(_load_one(pm, eps[0], labels[0], disabled, allow, strict))
    unmatched = sorted(allow - matched)
    if unmatched:
        found = sorted({r.name for r in records} | {r.distribution for r in records})
        warn_at(f"PLYX_PLUGINS names {', '.join(map(repr, unmatched))}, which match(es) no entry point or distribution "
                f"in the `{ENTRY_POINT_GROUP}` group (found: {', '.join(found) or 'none'}); check the spelling",
                _outside_plyx_specs())
    return records


def _load_one(pm: pluggy.PluginManager, ep: Any, label: tuple[str, str], disabled: bool, allow: set[str],
              strict: bool) -> PluginRecord:
    dist, version = label
    source = f"{dist} {version}".strip()
    if disabled:
        return PluginRecord(ep.name, dist, version, ep.value, "disabled", "PLYX_DISABLE_PLUGIN_AUTOLOAD is set")
    if allow and ep.name not in allow and dist not in allow:
        return PluginRecord(ep.name, dist, version, ep.value, "filtered", "not listed in PLYX_PLUGINS")
    try:
        plugin = ep.load()
    except Exception as exc:  # a plugin's import may fail in any way
        reason = f"failed to import {ep.value}: {type(exc).__name__}: {exc}"
        _fail(strict, PluginError(ep.name, source, reason), exc=exc)
        return PluginRecord(ep.name, dist, version, ep.value, "skipped", reason)
    ok, reason, contracts = _register(pm, plugin, ep.name, source, strict)
    if ok:
        _STATE.sources[ep.name] = source
    return PluginRecord(ep.name, dist, version, ep.value, "loaded" if ok else "skipped", reason, contracts)


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


def plugin_report(*, strict: bool | None = None) -> list[PluginRecord]:
    """What the scan found, loaded and skipped (scans first if needed).

    Args:
        strict: as for ``get_plugin_manager``; ``plyx plugins`` passes False so that it reports
            every problem instead of raising at the first.
    """
    get_plugin_manager(strict=strict)
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
    """Every item every implementation of a list hook returns, with the plugin that returned it.

    Each implementation is called on its own, so every result is attributed and
    one that raises (or returns something other than a list) is skipped with a
    warning naming its distribution and pointing at its code; strict mode raises.
    """
    pm = get_plugin_manager()
    caller = getattr(pm.hook, hook_name)
    strict = _truthy("PLYX_STRICT_PLUGINS")
    for impl in reversed(caller.get_hookimpls()):
        try:
            result = impl.function()
            items = list(result or ())
        except Exception as exc:  # a plugin's hook may fail in any way
            error = PluginError(impl.plugin_name, source_of(impl.plugin_name),
                                f"{hook_name} raised {type(exc).__name__}: {exc}")
            _fail(strict, error, plugin=impl.plugin, exc=exc)
            continue
        for item in items:
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
    """Subcommands contributed through ``plyx_cli_commands``, by name.

    A hook that raises or returns something other than ``CliCommand`` items is
    skipped with a warning naming its distribution; two plugins contributing one
    command name are both skipped (strict mode raises in each case), so one
    broken plugin never takes the ``plyx`` command down.
    """
    strict = _truthy("PLYX_STRICT_PLUGINS")
    found: dict[str, tuple[CliCommand, str]] = {}
    clashes: dict[str, list[str]] = {}
    for plugin_name, item in _collect("plyx_cli_commands"):
        source = source_of(plugin_name)
        if not isinstance(item, CliCommand) or not isinstance(getattr(item, "name", None), str):
            _fail(strict, PluginError(plugin_name, source, f"plyx_cli_commands returned {item!r}, not a CliCommand"),
                  plugin=_plugin_object(plugin_name))
            continue
        if item.name in found or item.name in clashes:
            clashes.setdefault(item.name, [found.pop(item.name)[1]] if item.name in found else []).append(source)
            continue
        found[item.name] = (item, source)
    for name, sources in clashes.items():
        error = PluginConflictError(f"plyx {name}", sources[0], sources[1])
        if strict:
            raise error
        warn_at(f"{error}; `plyx {name}` is left out (set PLYX_STRICT_PLUGINS=1 to raise)", _outside_plyx_specs())
    return {name: cmd for name, (cmd, _) in found.items()}


def _plugin_object(name: str) -> object | None:
    pm = _STATE.pm
    return pm.get_plugin(name) if pm is not None else None
