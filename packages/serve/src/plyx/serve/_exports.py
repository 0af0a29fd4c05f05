"""The public names of ``plyx.serve``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.serve.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.serve._beam import beam_search
from plyx.serve._generate import GenerationStream, generate, stream_generate
from plyx.serve._outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent, TokenLogprob
from plyx.serve._params import BeamSearchParams, SamplingParams, StructuredOutput
from plyx.serve._processors import SamplingState
