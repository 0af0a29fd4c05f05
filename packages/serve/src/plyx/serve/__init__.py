"""plyx-serve: the generation library (this release) under the continuous-batching engine and server.

Public surface (the serve ABI, stable across minor versions):

- ``generate(model, prompts, params, *, ...)`` -> ``list[RequestOutput]``
- ``stream_generate(...)``: the same, yielding ``StreamEvent`` as tokens are produced
- ``beam_search(model, prompts, BeamSearchParams, *, ...)`` -> ``list[RequestOutput]``
- ``SamplingParams``, ``StructuredOutput``, ``BeamSearchParams``: frozen request structs
- ``RequestOutput``, ``CompletionOutput``, ``TokenLogprob``, ``RequestMetrics``, ``StreamEvent``
- ``SamplingState``: what logits processors and samplers (``plyx_samplers`` plugins) receive
"""

from plyx.serve._beam import beam_search
from plyx.serve._generate import GenerationStream, generate, stream_generate
from plyx.serve._outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent, TokenLogprob
from plyx.serve._params import BeamSearchParams, SamplingParams, StructuredOutput
from plyx.serve._processors import SamplingState

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
