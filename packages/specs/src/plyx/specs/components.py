"""Small descriptor types that plugins return from hooks."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Component", "CliCommand", "deferred"]


@attrs.frozen
class Component:
    """A named, buildable piece: a KV-cache kind, a sampler, an optimizer, an exporter, a detector, a probe.

    Attributes:
        name: unique within its kind; what users write in configs.
        factory: builds the piece; its arguments are documented by the plane that consumes the kind.
        description: one line for ``plyx plugins``.
        source: the plugin that returned it (filled in by ``plyx.specs.plugins.components``).
    """

    name: str
    factory: Callable[..., Any] = attrs.field(eq=False)
    description: str = ""
    source: str = ""


@attrs.frozen
class CliCommand:
    """A ``plyx`` subcommand contributed by a plane.

    Attributes:
        name: the word after ``plyx`` (``train``, ``kernels``).
        help: one line shown by ``plyx --help``.
        configure: adds arguments (or nested subparsers) to the command's parser.
        run: executes the parsed command; returns an exit code (None means 0).
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None] = attrs.field(eq=False)
    run: Callable[[argparse.Namespace], int | None] = attrs.field(eq=False)


def deferred(target: str) -> Callable[..., Any]:
    """A callable that imports ``"package.module:attr"`` on its first call and then calls it.

    For plugin hooks that must stay light: a ``CliCommand`` built with
    ``deferred("my_plane._cli:configure")`` lets ``plyx --help`` list the command
    without importing the module that implements it.

    Args:
        target: ``module:attribute`` (dots in the attribute walk into it).

    Returns:
        a function with the target's behaviour; ``repr`` names the target.

    Example::

        CliCommand("train", "train a model", deferred("plyx.train._cli:configure_train"),
                   deferred("plyx.train._cli:run_train"))
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"deferred({target!r}): write the target as 'package.module:attribute'")
    resolved: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not resolved:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
            resolved.append(obj)
        return resolved[0](*args, **kwargs)

    call.__name__ = attr.rsplit(".", 1)[-1]
    call.__qualname__ = f"deferred({target})"
    call.__doc__ = f"``{target}``, imported on first call."
    return call
