"""The built-in plugin of plyx-export, registered under the `plyx` entry-point group.

Contributes the ``onnx``, ``hf`` and ``gguf`` exporters (``plyx_exporters``) and ``plyx export`` (``plyx_cli_commands``).
Nothing heavy is imported until a hook is called.
"""

from __future__ import annotations

from typing import Any

from plyx.specs import Component, hookimpl

plyx_contracts = {"hooks": "1.0"}


@hookimpl
def plyx_exporters() -> list[Any]:
    from plyx.export._gguf import write_gguf
    from plyx.export._hf import write_hf
    from plyx.export._onnx import write_onnx

    return [
        Component("onnx", write_onnx, "ONNX prefill graph input_ids [B, T] -> logits [B, T, V], or with "
                                      "--with-kv-cache the decoding graph (past/present key-values); int8 through "
                                      "onnxruntime.quantization; verified in onnxruntime"),
        Component("hf", write_hf, "Hugging Face directory (safetensors, config + generation config with the special "
                                  "token ids, tokenizer); verified with transformers"),
        Component("gguf", write_gguf, "llama.cpp GGUF (f16 or q8_0, tokenizer and architecture metadata) through "
                                      "the gguf package; verified with gguf's reader and transformers' GGUF loader"),
    ]


@hookimpl
def plyx_cli_commands() -> list[Any]:
    from plyx.export._cli import command

    return [command()]
