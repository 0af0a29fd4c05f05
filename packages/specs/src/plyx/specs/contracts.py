"""Frozen contracts: snapshot each contract's public surface and refuse breaking changes.

``contracts/<name>/v<MAJOR>.json`` holds the surface of one contract at one
major version: protocol methods and their signatures, struct and attrs fields
with types and defaults, hook specs with their flags, constants. ``check``
regenerates the surface from the code and compares it with the snapshot of
the code's current major version:

- purely additive changes (a new method, a new optional parameter, a new field
  with a default, a new hook) pass and are recorded in the snapshot;
- anything else (a removed or renamed member, a changed parameter, type or
  default) fails, naming each change, until the contract's major version is
  bumped and a new snapshot is written with ``snapshot``.

Config schemas have their own versions and migrations: a field change in a
schema whose ``VERSION`` went up with a registered migration is not a break.
"""

from __future__ import annotations

import enum
import inspect
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import msgspec

__all__ = ["SURFACES", "surface", "write_snapshots", "check_snapshots", "compare", "CheckReport"]


def _objects() -> dict[str, dict[str, Any]]:
    import importlib

    def mod(name: str) -> Any:  # by module path: plyx.specs re-exports names that shadow modules
        return importlib.import_module(f"plyx.specs.{name}")

    batch, checkpoint, components, config, hookspecs, kernels, kvcache, tensorspec, strategy = (
        mod(n) for n in ("batch", "checkpoint", "components", "config", "hookspecs", "kernels", "kvcache", "tensorspec",
                         "strategy")
    )

    payloads = mod("payloads")  # the typed metadata of the lifecycle hooks belongs to the hook contract
    hook_fns = {
        name: getattr(hookspecs, name) for name in dir(hookspecs) if name.startswith("plyx_")
    }
    return {
        "config": {
            name: getattr(config, name)
            for name in (
                "ConfigBase", "ModelConfig", "RopeScaling", "TrainConfig", "DataConfig", "OptimizerConfig",
                "ScheduleConfig", "ServeConfig", "KernelConfig", "DistConfig", "load_config", "dump_config", "migration",
            )
        },
        "tensorspec": {"TensorSpec": tensorspec.TensorSpec, "bind": tensorspec.bind, "dtype_name": tensorspec.dtype_name},
        "kvcache": {n: getattr(kvcache, n) for n in kvcache.__all__ if n != "CONTRACT_VERSION"},
        "kernels": {n: getattr(kernels, n) for n in kernels.__all__ if n != "CONTRACT_VERSION"},
        "checkpoint": {n: getattr(checkpoint, n) for n in checkpoint.__all__ if n != "CONTRACT_VERSION"},
        "batch": {n: getattr(batch, n) for n in batch.__all__ if n != "CONTRACT_VERSION"},
        "hooks": {**hook_fns, "Component": components.Component, "CliCommand": components.CliCommand,
                  "TrainStrategy": strategy.TrainStrategy,
                  **{n: getattr(payloads, n) for n in payloads.__all__ if n != "CONTRACT_VERSION"}},
    }


#: contract name -> callable returning its objects (for documentation)
SURFACES: Callable[[], dict[str, dict[str, Any]]] = _objects


def _type_name(tp: Any) -> str:
    if tp is inspect.Parameter.empty:
        return ""
    if isinstance(tp, str):
        return tp
    text = repr(tp) if not isinstance(tp, type) else f"{tp.__module__}.{tp.__qualname__}"
    return text.replace("typing.", "").replace("builtins.", "")


def _default(value: Any) -> str:
    if value is inspect.Parameter.empty or value is msgspec.NODEFAULT or value is attrs.NOTHING:
        return "<required>"
    if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
        return f"<factory {getattr(value.factory, '__name__', value.factory)}>"
    return repr(value)


def _signature(fn: Any) -> dict[str, Any]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {"params": [], "returns": ""}
    hints: dict[str, Any] = {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolved forward references keep their string form
        hints = {}
    params = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        params.append({
            "name": p.name,
            "kind": p.kind.name,
            "type": _type_name(hints.get(p.name, p.annotation)),
            "default": _default(p.default),
        })
    return {"params": params, "returns": _type_name(hints.get("return", sig.return_annotation))}


_DUNDERS = ("__iter__", "__call__", "__len__", "__contains__", "__enter__", "__exit__")


def _protocol_members(cls: type) -> list[str]:
    """Names a protocol declares (its own and its protocol bases'), the same on every Python."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base in (object, typing.Protocol, typing.Generic) or not getattr(base, "_is_protocol", False):
            continue
        names.update(n for n in vars(base) if not n.startswith("_") or n in _DUNDERS)
    return sorted(names)


def _describe(obj: Any) -> dict[str, Any]:
    from plyx.specs.config._base import ConfigBase

    if isinstance(obj, type) and issubclass(obj, BaseException):
        return {"kind": "exception", "bases": [b.__name__ for b in obj.__mro__[1:] if b is not object]}
    if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        out: dict[str, Any] = {"kind": "struct", "fields": {}}
        hints = typing.get_type_hints(obj, include_extras=True)
        for f in msgspec.structs.fields(obj):
            default = f.default if f.default is not msgspec.NODEFAULT else (
                f"<factory {getattr(f.default_factory, '__name__', '?')}>" if f.default_factory is not msgspec.NODEFAULT
                else msgspec.NODEFAULT
            )
            out["fields"][f.name] = {
                "type": _type_name(hints.get(f.name, f.type)),
                "default": default if isinstance(default, str) and default.startswith("<factory") else _default(default),
            }
        if issubclass(obj, ConfigBase):
            out["schema"] = obj.SCHEMA
            out["schema_version"] = obj.VERSION
        return out
    if isinstance(obj, type) and attrs.has(obj):
        fields = {
            a.name: {"type": _type_name(a.type), "default": _default(a.default)} for a in attrs.fields(obj)
        }
        methods = {
            name: _signature(member)
            for name, member in inspect.getmembers(obj)
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
            and not isinstance(member, property)
        }
        props = sorted(name for name, m in inspect.getmembers(obj) if isinstance(m, property) and not name.startswith("_"))
        return {"kind": "attrs", "fields": fields, "methods": methods, "properties": props}
    if isinstance(obj, type) and getattr(obj, "_is_protocol", False):
        members: dict[str, Any] = {}
        for name in _protocol_members(obj):
            member = inspect.getattr_static(obj, name, None)
            if isinstance(member, property):
                members[name] = {"property": _signature(member.fget)["returns"]}
            elif callable(member):
                members[name] = _signature(member)
        return {"kind": "protocol", "members": members}
    if inspect.isfunction(obj):
        out = {"kind": "function", **_signature(obj)}
        spec_opts = getattr(obj, "plyx_spec", None)
        if isinstance(spec_opts, dict):
            out["hook"] = {k: bool(v) for k, v in sorted(spec_opts.items()) if k in ("firstresult", "historic")}
        return out
    if isinstance(obj, enum.EnumMeta):
        return {"kind": "enum", "members": [m.name for m in obj]}
    if isinstance(obj, (tuple, list, frozenset, set)):
        return {"kind": "constant-set", "values": sorted(map(str, obj))}
    if isinstance(obj, dict):
        return {"kind": "constant-map", "values": {str(k): repr(v) for k, v in sorted(obj.items(), key=str)}}
    return {"kind": "constant", "value": repr(obj)}


def surface(contract: str) -> dict[str, Any]:
    """The public surface of one contract as plain JSON-able data."""
    objects = _objects()[contract]
    return {name: _describe(obj) for name, obj in sorted(objects.items())}


def _version(contract: str) -> str:
    from plyx.specs.plugins import contract_versions

    return contract_versions()[contract]


def _major(version: str) -> int:
    return int(version.split(".")[0])


def snapshot_path(root: Path, contract: str, major: int) -> Path:
    return root / contract / f"v{major}.json"


def _write(path: Path, contract: str, version: str, surf: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"contract": contract, "version": version, "surface": surf}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_snapshots(root: str | Path = "contracts") -> list[Path]:
    """Write the snapshot of every contract at its current major version."""
    base = Path(root)
    written = []
    for contract in _objects():
        version = _version(contract)
        path = snapshot_path(base, contract, _major(version))
        _write(path, contract, version, surface(contract))
        written.append(path)
    return written


# -- comparison ------------------------------------------------------------------
def _compare_params(where: str, old: dict[str, Any], new: dict[str, Any], breaks: list[str], adds: list[str]) -> None:
    old_params = {p["name"]: p for p in old.get("params", [])}
    new_params = {p["name"]: p for p in new.get("params", [])}
    old_order = [p["name"] for p in old.get("params", [])]
    new_order = [p["name"] for p in new.get("params", [])]
    for name, p in old_params.items():
        q = new_params.get(name)
        if q is None:
            breaks.append(f"{where}: parameter `{name}` was removed")
            continue
        for key in ("kind", "type", "default"):
            if p[key] != q[key]:
                breaks.append(f"{where}: parameter `{name}` {key} changed from {p[key]!r} to {q[key]!r}")
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    old_pos = [n for n in old_order if old_params[n]["kind"] in positional]
    new_pos = [n for n in new_order if n in old_params and new_params[n]["kind"] in positional]
    if old_pos != new_pos:
        breaks.append(f"{where}: positional parameters reordered from {old_pos} to {new_pos}")
    for name in new_order:
        if name in old_params:
            continue
        p = new_params[name]
        if p["default"] == "<required>" and p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            breaks.append(f"{where}: new required parameter `{name}`")
        else:
            adds.append(f"{where}: new optional parameter `{name}`")
    if old.get("returns") != new.get("returns"):
        breaks.append(f"{where}: return type changed from {old.get('returns')!r} to {new.get('returns')!r}")


def _compare_dicts(
    where: str, old: dict[str, Any], new: dict[str, Any], breaks: list[str], adds: list[str],
    compare_item: Callable[[str, Any, Any], None], added_is_break: Callable[[str, Any], bool] = lambda n, v: False,
) -> None:
    for name, value in old.items():
        if name not in new:
            breaks.append(f"{where}.{name} was removed")
        else:
            compare_item(f"{where}.{name}", value, new[name])
    for name, value in new.items():
        if name not in old:
            (breaks if added_is_break(name, value) else adds).append(f"{where}.{name} was added")


def _compare_object(where: str, old: dict[str, Any], new: dict[str, Any], breaks: list[str], adds: list[str]) -> None:
    if old.get("kind") != new.get("kind"):
        breaks.append(f"{where}: changed from a {old.get('kind')} to a {new.get('kind')}")
        return
    kind = old["kind"]
    if kind in ("function",):
        _compare_params(where, old, new, breaks, adds)
        if old.get("hook") != new.get("hook"):
            breaks.append(f"{where}: hook options changed from {old.get('hook')} to {new.get('hook')}")
    elif kind == "protocol":
        def member(w: str, a: Any, b: Any) -> None:
            if "property" in a or "property" in b:
                if a != b:
                    breaks.append(f"{w}: changed from {a} to {b}")
            else:
                _compare_params(w, a, b, breaks, adds)
        _compare_dicts(where, old["members"], new["members"], breaks, adds, member)
    elif kind in ("struct", "attrs"):
        migrated = (
            kind == "struct" and "schema_version" in old
            and new.get("schema_version", 0) > old["schema_version"]
        )
        sink = adds if migrated else breaks

        def field(w: str, a: Any, b: Any) -> None:
            for key in ("type", "default"):
                if a[key] != b[key]:
                    sink.append(f"{w}: {key} changed from {a[key]!r} to {b[key]!r}")

        field_breaks: list[str] = []
        _compare_dicts(
            where, old["fields"], new["fields"], field_breaks, adds, field,
            added_is_break=lambda n, v: v["default"] == "<required>",
        )
        sink.extend(field_breaks)
        if migrated:
            adds.append(f"{where}: schema version {old['schema_version']} -> {new['schema_version']} (migrated)")
        if kind == "attrs":
            _compare_dicts(where, old.get("methods", {}), new.get("methods", {}), breaks, adds,
                           lambda w, a, b: _compare_params(w, a, b, breaks, adds))
            for prop in set(old.get("properties", [])) - set(new.get("properties", [])):
                breaks.append(f"{where}.{prop}: property removed")
    elif kind == "exception":
        missing = set(old["bases"]) - set(new["bases"])
        if missing:
            breaks.append(f"{where}: no longer a subclass of {', '.join(sorted(missing))}")
    elif kind == "constant-set":
        removed = set(old["values"]) - set(new["values"])
        if removed:
            breaks.append(f"{where}: values removed: {', '.join(sorted(removed))}")
        if set(new["values"]) - set(old["values"]):
            adds.append(f"{where}: values added")
    elif old != new:
        breaks.append(f"{where}: changed from {old} to {new}")


def compare(contract: str, old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(breaking changes, additive changes) between two surfaces of ``contract``."""
    breaks: list[str] = []
    adds: list[str] = []
    _compare_dicts(contract, old, new, breaks, adds, lambda w, a, b: _compare_object(w, a, b, breaks, adds))
    return breaks, adds


@attrs.frozen
class CheckReport:
    ok: bool
    lines: list[str]


def check_snapshots(root: str | Path = "contracts", *, update: bool = True) -> CheckReport:
    """Compare every contract with its snapshot; record additive changes when ``update``."""
    base = Path(root)
    ok = True
    lines: list[str] = []
    for contract in _objects():
        version = _version(contract)
        major = _major(version)
        path = snapshot_path(base, contract, major)
        new = surface(contract)
        if not path.exists():
            ok = False
            lines.append(
                f"FAIL {contract}: no snapshot {path} for major version {major}; "
                f"run `plyx contracts snapshot --dir {base}` and commit it"
            )
            continue
        old_doc = json.loads(path.read_text(encoding="utf-8"))
        breaks, adds = compare(contract, old_doc["surface"], new)
        if breaks:
            ok = False
            lines.append(f"FAIL {contract} v{major}: {len(breaks)} breaking change(s):")
            lines.extend(f"  - {b}" for b in breaks)
            lines.append(
                f"  fix: restore the old surface, or bump the major of the {contract} contract "
                f"(now {version}) and run `plyx contracts snapshot --dir {base}` to add v{major + 1}.json"
            )
        elif adds:
            lines.append(f"ok   {contract} v{major}: {len(adds)} additive change(s)" + (" recorded" if update else ""))
            lines.extend(f"  + {a}" for a in adds)
            if update:
                _write(path, contract, version, new)
        else:
            lines.append(f"ok   {contract} v{major}: unchanged")
    return CheckReport(ok, lines)
