"""Frozen contracts: snapshot each contract's public surface and refuse breaking changes.

``contracts/<name>/v<MAJOR>.json`` holds the surface of one contract at one
major version: protocol methods and their signatures, struct and attrs fields
with types and defaults, hook specs with their flags, constants. ``check``
regenerates the surface from the code and compares it with the snapshot of
the code's current major version:

- purely additive changes pass; ``check`` itself never writes, and
  ``record_additive`` (``plyx contracts record-additive``) records them, only
  when no contract has a breaking change;
- anything else fails, naming each change, until the contract's major version
  is bumped and a new snapshot is written with ``snapshot``, which refuses to
  overwrite an existing major's file with a breaking change.

What counts as additive depends on the kind of object (who provides it, who
calls it):

- protocols (``KVCache``, ``KernelRegistry``, ``Checkpoint``) are provided by
  implementers and checked with ``isinstance``: every member is required, so a
  new member, a new parameter (even an optional one: callers will pass it and
  existing implementations reject it) or a removed one is breaking. An
  optional capability is a new, separate protocol (additive);
- functions, hook specs, structs and attrs classes are provided by plyx and
  called (or built) by others: a new optional parameter or field is additive,
  a new required one is breaking. Hook implementations take a subset of a
  spec's parameters, so any new hook parameter is additive;
- constant maps are compared by structure: a new key, or a new field of a
  value's class, is additive; a removed or changed one is breaking.

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

__all__ = [
    "SURFACES", "surface", "write_snapshots", "check_snapshots", "record_additive", "compare", "CheckReport",
    "SnapshotRefused",
]


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
                "ScheduleConfig", "ServeConfig", "KernelConfig", "DistConfig", "CardConfig", "load_config", "dump_config", "migration",
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
        return {"kind": "constant-map", "values": {str(k): _structure(v) for k, v in sorted(obj.items(), key=str)}}
    return {"kind": "constant", "value": repr(obj)}


def _structure(value: Any) -> Any:
    """A constant's value as structure: ``{"type": ..., "fields": {name: repr}}`` for attrs/struct instances."""
    if attrs.has(type(value)):
        names = [a.name for a in attrs.fields(type(value))]
    elif isinstance(value, msgspec.Struct):
        names = list(type(value).__struct_fields__)
    else:
        return repr(value)
    return {"type": type(value).__name__, "fields": {n: repr(getattr(value, n)) for n in names}}


def _legacy_structure(text: str) -> Any:
    """Read a value recorded as ``repr`` text by older snapshots (``Cls(a=..., b=...)``) as structure."""
    import ast

    try:
        node = ast.parse(text, mode="eval").body
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            fields = {k.arg: repr(ast.literal_eval(k.value)) for k in node.keywords if k.arg}
            return {"type": node.func.id, "fields": fields}
    except (SyntaxError, ValueError):
        pass
    return text


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


def _write(path: Path, contract: str, version: str, surf: dict[str, Any], behaviour: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"contract": contract, "version": version, "surface": surf, "behaviour": behaviour}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_snapshots(root: str | Path = "contracts") -> list[Path]:
    """Write the snapshot of every contract at its current major version.

    A major version whose file exists is frozen: it is rewritten only when the
    change is additive (as ``record_additive`` does). A breaking change needs a
    new major version (bump the contract's ``CONTRACT_VERSION``), which gets a
    new file. Nothing is written when any contract would be refused.

    Raises:
        SnapshotRefused: naming each contract whose frozen file would take a breaking change.
    """
    from plyx.specs._behaviour import behaviour

    base = Path(root)
    planned = []
    refused = []
    for contract in _objects():
        version = _version(contract)
        path = snapshot_path(base, contract, _major(version))
        if path.exists():
            breaks, _, _, _ = _diff(contract, _load(path))
            if breaks:
                refused.append(f"{contract} v{_major(version)} ({path}): " + "; ".join(breaks))
                continue
        planned.append((path, contract, version))
    if refused:
        raise SnapshotRefused(
            "refusing to overwrite frozen contract snapshot(s) with breaking changes:\n  - " + "\n  - ".join(refused)
            + "\nfix: restore the old surface, or bump the contract's major version (CONTRACT_VERSION) so the "
            "change gets a new v<N>.json"
        )
    for path, contract, version in planned:
        _write(path, contract, version, surface(contract), behaviour(contract))
    return [path for path, _, _ in planned]


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
        # implementers provide protocols: whatever isinstance or a caller may now need of them breaks them
        def member(w: str, a: Any, b: Any) -> None:
            if "property" in a or "property" in b:
                if a != b:
                    breaks.append(f"{w}: changed from {a} to {b}")
                return
            member_adds: list[str] = []
            _compare_params(w, a, b, breaks, member_adds)
            breaks.extend(f"{m} (existing implementations of the protocol do not accept it)" for m in member_adds)
        _compare_dicts(where, old["members"], {k: v for k, v in new["members"].items() if k in old["members"]},
                       breaks, adds, member)
        for name in sorted(set(new["members"]) - set(old["members"])):
            breaks.append(f"{where}.{name}: new required member of a protocol that implementers provide "
                          f"(existing implementations no longer pass isinstance); declare it in a separate "
                          f"protocol to keep it optional")
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
    elif kind == "constant-map":
        _compare_dicts(where, old["values"], new["values"], breaks, adds,
                       lambda w, a, b: _compare_value(w, a, b, breaks, adds))
    elif old != new:
        breaks.append(f"{where}: changed from {old} to {new}")


def _compare_value(where: str, old: Any, new: Any, breaks: list[str], adds: list[str]) -> None:
    old = _legacy_structure(old) if isinstance(old, str) else old
    new = _legacy_structure(new) if isinstance(new, str) else new
    if not (isinstance(old, dict) and isinstance(new, dict)) or old.get("type") != new.get("type"):
        if old != new:
            breaks.append(f"{where}: changed from {old} to {new}")
        return
    for name, value in old["fields"].items():
        if name not in new["fields"]:
            breaks.append(f"{where}.{name}: field removed")
        elif new["fields"][name] != value:
            breaks.append(f"{where}.{name}: changed from {value} to {new['fields'][name]}")
    for name in new["fields"]:
        if name not in old["fields"]:
            adds.append(f"{where}.{name}: new field ({new['fields'][name]})")


def compare(contract: str, old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(breaking changes, additive changes) between two surfaces of ``contract``."""
    breaks: list[str] = []
    adds: list[str] = []
    _compare_dicts(contract, old, new, breaks, adds, lambda w, a, b: _compare_object(w, a, b, breaks, adds))
    return breaks, adds


@attrs.frozen
class CheckReport:
    """What a check found: ``ok`` when nothing breaks; ``lines`` to print; ``additive`` contracts with additions."""

    ok: bool
    lines: list[str]
    additive: tuple[str, ...] = ()


class SnapshotRefused(RuntimeError):
    """``snapshot`` would overwrite a frozen major version's file with a breaking change."""


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _compare_behaviour(contract: str, old: dict[str, Any] | None, new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Frozen behaviour vectors: a changed outcome breaks; a new probe (or none recorded yet) is additive."""
    if old is None:
        return [], [f"{contract}: behaviour vectors not frozen yet ({len(new)} probe(s))"] if new else []
    breaks = [
        f"{contract} behaviour: {probe}: was {old[probe]!r}, now {new.get(probe, '<no longer probed>')!r}"
        for probe in sorted(old) if new.get(probe, "<no longer probed>") != old[probe]
    ]
    adds = [f"{contract} behaviour: new probe {probe}" for probe in sorted(set(new) - set(old))]
    return breaks, adds


def _diff(contract: str, doc: dict[str, Any]) -> tuple[list[str], list[str], dict[str, Any], dict[str, Any]]:
    from plyx.specs._behaviour import behaviour

    new, new_behaviour = surface(contract), behaviour(contract)
    breaks, adds = compare(contract, doc["surface"], new)
    b_breaks, b_adds = _compare_behaviour(contract, doc.get("behaviour"), new_behaviour)
    return breaks + b_breaks, adds + b_adds, new, new_behaviour


def check_snapshots(root: str | Path = "contracts", *, update: bool = False) -> CheckReport:
    """Compare every contract (surface and frozen behaviour) with its snapshot. Read-only.

    Args:
        root: the snapshot directory.
        update: record the additive changes afterwards, only when no contract breaks
            (``record_additive``); the check itself never writes.
    """
    base = Path(root)
    ok = True
    lines: list[str] = []
    additive: list[str] = []
    for contract in _objects():
        version = _version(contract)
        major = _major(version)
        path = snapshot_path(base, contract, major)
        if not path.exists():
            ok = False
            lines.append(
                f"FAIL {contract}: no snapshot {path} for major version {major}; "
                f"run `plyx contracts snapshot --dir {base}` and commit it"
            )
            continue
        breaks, adds, _, _ = _diff(contract, _load(path))
        if breaks:
            ok = False
            lines.append(f"FAIL {contract} v{major}: {len(breaks)} breaking change(s):")
            lines.extend(f"  - {b}" for b in breaks)
            lines.append(
                f"  fix: restore the old surface, or bump the major of the {contract} contract "
                f"(now {version}) and run `plyx contracts snapshot --dir {base}` to add v{major + 1}.json"
            )
        elif adds:
            additive.append(contract)
            lines.append(f"ok   {contract} v{major}: {len(adds)} additive change(s), not recorded "
                          f"(`plyx contracts record-additive --dir {base}` records them)")
            lines.extend(f"  + {a}" for a in adds)
        else:
            lines.append(f"ok   {contract} v{major}: unchanged")
    report = CheckReport(ok, lines, tuple(additive))
    if update and ok and additive:
        return record_additive(root)
    return report


def record_additive(root: str | Path = "contracts") -> CheckReport:
    """Record every contract's additive changes in its snapshot, only when no contract has a breaking change.

    Returns:
        the check's report; nothing is written when ``report.ok`` is False.
    """
    report = check_snapshots(root)
    if not report.ok:
        return CheckReport(False, [*report.lines, "nothing recorded: fix the breaking change(s) first"])
    base = Path(root)
    lines = list(report.lines)
    for contract in report.additive:
        version = _version(contract)
        path = snapshot_path(base, contract, _major(version))
        _, _, new, new_behaviour = _diff(contract, _load(path))
        _write(path, contract, version, new, new_behaviour)
        lines.append(f"recorded {path}")
    return CheckReport(True, lines, report.additive)
