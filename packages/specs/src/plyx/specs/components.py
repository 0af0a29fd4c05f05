"""Small descriptor types that plugins return from hooks."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Component", "CliCommand"]


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
