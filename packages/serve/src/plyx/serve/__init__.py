"""plyx-serve: the generation library (this release) under the continuous-batching engine and server.

Public surface (the serve ABI, stable across minor versions):

- ``generate(model, prompts, params, *, ...)`` -> ``list[RequestOutput]``
- ``stream_generate(...)``: the same, yielding ``StreamEvent`` as tokens are produced
- ``beam_search(model, prompts, BeamSearchParams, *, ...)`` -> ``list[RequestOutput]``
- ``SamplingParams``, ``StructuredOutput``, ``BeamSearchParams``: frozen request structs
- ``RequestOutput``, ``CompletionOutput``, ``TokenLogprob``, ``RequestMetrics``, ``StreamEvent``
- ``SamplingState``: what logits processors and samplers (``plyx_samplers`` plugins) receive
"""

from typing import Any

__all__ = [
    "BeamSearchParams",
    "CompletionOutput",
    "GenerationStream",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SamplingState",
    "StreamEvent",
    "StructuredOutput",
    "TokenLogprob",
    "beam_search",
    "generate",
    "stream_generate",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.serve`` (and so its plugin entry point, ``plyx.serve._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.serve._exports``.
    """
    if name in __all__:
        from plyx.serve import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
