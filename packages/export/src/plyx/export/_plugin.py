"""The built-in plugin of plyx-export, registered under the `plyx` entry-point group.

Contributes the ``onnx`` exporter (``plyx_exporters``) and ``plyx export`` (``plyx_cli_commands``).
Nothing heavy is imported until a hook is called.
"""

from __future__ import annotations

from typing import Any

from plyx.specs import Component, hookimpl

plyx_contracts = {"hooks": "1.0"}


@hookimpl
def plyx_exporters() -> list[Any]:
    from plyx.export._onnx import write_onnx

    return [Component("onnx", write_onnx, "ONNX prefill graph input_ids [B, T] -> logits [B, T, V] "
                                          "(torch.onnx dynamo), verified in onnxruntime")]


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.export._cli import command

    return [command()]
