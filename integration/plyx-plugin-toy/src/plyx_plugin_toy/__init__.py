"""A toy plyx plugin: everything here reaches plyx through hooks only."""

from __future__ import annotations

import argparse

from plyx.specs import CliCommand, Component, hookimpl

#: the contract versions this plugin was written against
plyx_contracts = {"hooks": "1.0"}

#: steps seen by plyx_on_train_step_end (lets tests observe the lifecycle hook)
STEPS: list[int] = []


def _first_token(**_: object):
    """A 'sampler' that always picks token 0 (the toy has no torch)."""
    return lambda logits, state=None: 0


@hookimpl
def plyx_samplers() -> list[Component]:
    return [Component("toy_first_token", _first_token, "always token 0 (toy plugin)")]


@hookimpl
def plyx_on_train_step_end(step: int, metrics: dict[str, float]) -> None:
    STEPS.append(step)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--echo", default="toy", help="what to print")


def _run(args: argparse.Namespace) -> int:
    print(f"toy says {args.echo}")
    return 0


@hookimpl
def plyx_cli_commands() -> list[CliCommand]:
    return [CliCommand("toy", "a command added by the toy plugin", _configure, _run)]
