"""The versioned configuration base: strict structs, three file formats, migrations.

A config is a frozen, keyword-only ``msgspec.Struct`` that rejects unknown
keys. Every document carries ``version``; loading a document written under an
older schema applies the registered ``vN -> vN+1`` migrations in order before
validation, so old files keep working after a schema change.

Errors are ``ConfigError`` (a ``ValueError``) naming the path, the value and
the fix, e.g.::

    ConfigError: `n_heads` (6) must divide `d_model` (512) - at `$.n_heads` (got 6);
    choose n_heads from 1, 2, 4, 8, 16, ... or set `head_dim` explicitly
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec
from plyx.specs.errors import ConfigError

__all__ = ["ConfigBase", "migration", "migrations_for", "load_config", "dump_config", "FORMATS"]

C = TypeVar("C", bound="ConfigBase")
Migration = Callable[[dict[str, Any]], dict[str, Any]]

#: file suffix -> format name
FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}

# (schema name, from_version) -> function turning a vN dict into a vN+1 dict
_MIGRATIONS: dict[tuple[str, int], Migration] = {}


class ConfigBase(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every plyx configuration schema.

    Subclasses set ``SCHEMA`` (a stable name used by migrations) and
    ``VERSION`` (the current schema version), and may override ``check`` for
    rules that span several fields.
    """

    SCHEMA: ClassVar[str] = "config"
    VERSION: ClassVar[int] = 1

    version: int = 0
    """Schema version of the document; 0 means "the current one" and is
    replaced by ``VERSION`` when the config is built."""

    def __post_init__(self) -> None:
        if self.version == 0:
            msgspec.structs.force_setattr(self, "version", type(self).VERSION)
        elif self.version != type(self).VERSION:
            raise ConfigError(
                "version",
                f"{type(self).__name__} is at schema version {type(self).VERSION}",
                value=self.version,
                fix="load the document with load_config()/from_dict(), which migrates old versions",
            )
        self.check()

    def check(self) -> None:
        """Validate rules across fields; raise ``ConfigError`` with a relative path."""

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], *, source: str = "") -> C:
        """Migrate ``data`` to the current version and validate it strictly."""
        if not isinstance(data, Mapping):
            raise ConfigError("$", f"a {cls.__name__} document must be a table/object", value=data)
        migrated = migrate(cls, dict(data))
        try:
            return msgspec.convert(migrated, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise _translate(exc, cls, migrated, source) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain builtin types, ready for any of the formats."""
        return msgspec.to_builtins(self)

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied and validated again."""
        data = self.to_dict()
        data.update(msgspec.to_builtins(changes))
        return type(self).from_dict(data)


def migration(schema: str, from_version: int) -> Callable[[Migration], Migration]:
    """Register ``fn`` as the migration of ``schema`` from ``from_version`` to the next.

    Example::

        @migration("model", 1)
        def _model_v1_to_v2(doc: dict) -> dict: ...
    """

    def register(fn: Migration) -> Migration:
        key = (schema, from_version)
        if key in _MIGRATIONS and _MIGRATIONS[key] is not fn:
            raise ValueError(f"a migration of {schema!r} from v{from_version} is already registered")
        _MIGRATIONS[key] = fn
        return fn

    return register


def migrations_for(schema: str) -> dict[int, Migration]:
    """The registered migrations of ``schema``, keyed by the version they start from."""
    return {v: fn for (s, v), fn in sorted(_MIGRATIONS.items()) if s == schema}


def migrate(cls: type[ConfigBase], data: dict[str, Any]) -> dict[str, Any]:
    version = data.get("version", 0) or cls.VERSION
    if not isinstance(version, int) or isinstance(version, bool):
        raise ConfigError("$.version", "the schema version must be an integer", value=version)
    if version > cls.VERSION:
        raise ConfigError(
            "$.version",
            f"{cls.__name__} documents of version {version} are newer than this plyx-specs "
            f"(which reads up to version {cls.VERSION})",
            value=version,
            fix="upgrade plyx-specs",
        )
    data = _migrate_nested(cls, data)
    while version < cls.VERSION:
        step = _MIGRATIONS.get((cls.SCHEMA, version))
        if step is None:
            raise ConfigError(
                "$.version",
                f"no migration of {cls.__name__} from version {version} to {version + 1} is registered",
                value=version,
            )
        data = step(dict(data))
        version += 1
        data["version"] = version
    return data


def _migrate_nested(cls: type[ConfigBase], data: dict[str, Any]) -> dict[str, Any]:
    """Nested configs (a ModelConfig inside a TrainConfig) carry their own versions."""
    for field in msgspec.structs.fields(cls):
        sub = field.type
        if isinstance(sub, type) and issubclass(sub, ConfigBase) and isinstance(data.get(field.name), Mapping):
            data[field.name] = migrate(sub, dict(data[field.name]))
    return data


# -- errors ----------------------------------------------------------------------
_AT = re.compile(r"^(?P<msg>.*) - at `(?P<path>[^`]*)`$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def _translate(exc: msgspec.ValidationError, cls: type, data: Any, source: str) -> ConfigError:
    text = str(exc)
    match = _AT.match(text)
    message, path = (match["msg"], match["path"]) if match else (text, "$")
    where = f"{source}: " if source else ""
    cause = exc.__cause__
    if isinstance(cause, ConfigError):
        # raised by a check(): its path is relative to the struct msgspec points at
        sub = cause.path if cause.path.startswith("$") else f"{path}.{cause.path}"
        sub = sub.replace("$.$", "$")
        return ConfigError(sub, where + cause.problem, value=cause.value, fix=cause.fix)
    if isinstance(cause, (ValueError, TypeError)):
        return ConfigError(path, where + str(cause))
    if m := _UNKNOWN.search(message):
        field = m["field"]
        target = _struct_at(cls, path)
        known = [f.name for f in msgspec.structs.fields(target)] if target else []
        close = difflib.get_close_matches(field, known, n=1)
        fix = f"did you mean `{close[0]}`?" if close else f"known fields are: {', '.join(known)}"
        return ConfigError(f"{path}.{field}".replace("$.$", "$"), where + "unknown field", fix=fix)
    if m := _MISSING.search(message):
        return ConfigError(f"{path}.{m['field']}", where + "required field is missing", fix="add it")
    value = _value_at(data, path)
    fix = ""
    if m := re.match(r"Expected (`[^`]+`[^,]*)", message):
        fix = f"write it as {m[1]}"
    return ConfigError(path, where + message, value=value, fix=fix)


def _value_at(data: Any, path: str) -> Any:
    node = data
    for part in re.findall(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]", path):
        key, index = part
        try:
            node = node[key] if key else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _struct_at(cls: type, path: str) -> type | None:
    """Follow ``path`` through nested struct fields, for "did you mean" hints."""
    import typing

    node: Any = cls
    for key, index in re.findall(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]", path):
        if index:
            continue  # a list's element type was already taken from its annotation
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return None
        field = {f.name: f for f in msgspec.structs.fields(node)}.get(key)
        if field is None:
            return None
        node = field.type
        for arg in (typing.get_args(node) or (node,)):
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                node = arg
                break
    return node if isinstance(node, type) and issubclass(node, msgspec.Struct) else None


# -- files -----------------------------------------------------------------------
def _format_of(path: Path, fmt: str | None) -> str:
    if fmt:
        if fmt not in {"json", "toml", "yaml"}:
            raise ValueError(f"unknown config format {fmt!r}; use json, toml or yaml")
        return fmt
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its suffix; "
            f"use one of {', '.join(FORMATS)} or pass fmt="
        ) from None


def _need(module: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"reading or writing this format needs `{module}`; install it with "
            f"`pip install 'plyx-specs[{extra}]'`"
        ) from None


def parse_text(text: str | bytes, fmt: str) -> Any:
    """Parse a document in ``fmt`` into builtin types (no validation)."""
    if fmt == "json":
        return json.loads(text)
    if fmt == "toml":
        raw = text.decode() if isinstance(text, bytes) else text
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - exercised on 3.10 in the matrix
            tomllib = _need("tomli", "formats")
        return tomllib.loads(raw)
    yaml = _need("yaml", "formats")
    return yaml.safe_load(text)


def render_text(data: Mapping[str, Any], fmt: str) -> str:
    """Render builtin ``data`` as a document in ``fmt``."""
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False) + "\n"
    if fmt == "toml":
        tomli_w = _need("tomli_w", "formats")
        return tomli_w.dumps(_drop_none(data))
    yaml = _need("yaml", "formats")
    return yaml.safe_dump(dict(data), sort_keys=False)


def _drop_none(data: Any) -> Any:
    # TOML has no null: an unset optional field is simply left out.
    if isinstance(data, Mapping):
        return {k: _drop_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [_drop_none(v) for v in data]
    return data


def load_config(cls: type[C], path: str | os.PathLike[str], *, fmt: str | None = None) -> C:
    """Load ``path`` (JSON, TOML or YAML by suffix) as ``cls``, migrating old versions.

    Example::

        cfg = load_config(ModelConfig, "model.toml")
    """
    p = Path(path)
    kind = _format_of(p, fmt)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {str(p)!r} does not exist") from None
    try:
        data = parse_text(raw, kind)
    except Exception as exc:  # each parser has its own error type
        if isinstance(exc, ImportError):
            raise
        raise ConfigError("$", f"{p}: not valid {kind.upper()}: {exc}") from None
    return cls.from_dict(data if data is not None else {}, source=str(p))


def dump_config(config: ConfigBase, path: str | os.PathLike[str], *, fmt: str | None = None) -> Path:
    """Write ``config`` atomically (temp file + rename) in the format of ``path``'s suffix."""
    p = Path(path)
    text = render_text(config.to_dict(), _format_of(p, fmt))
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
    return p
