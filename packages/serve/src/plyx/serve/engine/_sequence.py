"""Host-side state of the engine: a request (one prompt, ``n`` completions) and its sequences."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch
from plyx.serve._completion import Completion
from plyx.serve._params import SamplingParams

__all__ = ["EngineRequest", "SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its cache entry was dropped; recomputed on resume)
    RUNNING = "running"  # in the batch, holding cache blocks
    FOLLOWER = "follower"  # completion i > 0 of a request, forked from completion 0 once its prompt is computed
    FINISHED = "finished"


class Sequence:
    """One completion being computed: every token known so far and how many of them are in the cache.

    ``tokens[:num_computed]`` have keys and values in the cache; the step feeds
    ``tokens[num_computed:]`` (a prefill chunk, a recompute after preemption, or the
    one token sampled last) and samples a new token when it reaches the end.
    """

    def __init__(self, request: EngineRequest, index: int, seq_id: int, completion: Completion,
                 generator: torch.Generator | None, matcher: Any, seed: int = 0) -> None:
        self.request = request
        self.index = index
        self.seq_id = seq_id
        self.completion = completion
        self.generator = generator  # seeded requests' torch generator (plugin samplers, speculative drafts)
        # the 64-bit key of this row's counter-based random stream (``engine._sampling.row_uniforms``): the
        # request's seed + index, or drawn at admission for an unseeded request
        self.seed = seed
        self.uniforms: tuple[int, Any] | None = None  # (first token index, the next uniforms of its stream)
        self.matcher = matcher
        self.tokens: list[int] = list(request.prompt_ids)
        self.num_computed = 0
        self.status = SeqStatus.WAITING
        self.prefix_node: Any = None  # deepest prefix-cache node of this sequence's prompt
        self.prefix_depth = 0
        self.num_preemptions = 0
        # per-row sampling state, built only for rows whose processors read it (penalties, min_tokens)
        self.prompt_mask: torch.Tensor | None = None  # [V] bool
        self.output_counts: torch.Tensor | None = None  # [V] int32

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.tokens) - self.num_computed

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.request.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.completion.finished or self.status is SeqStatus.FINISHED


class EngineRequest:
    """A prompt and its ``n`` completions, as the engine tracks it.

    Attributes:
        request_id: the caller's id. prompt_ids: its tokens. params: its ``SamplingParams``.
        seqs: the ``n`` sequences (index order). arrival: ``time.monotonic()`` at admission.
        aborted: set by ``Engine.abort``.
    """

    def __init__(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                 arrival: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seqs: list[Sequence] = []
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.aborted = False
        self.adapter: str | None = None  # the LoRA adapter it runs through (None: the base model)
        self.guard: Any = None  # its RequestGuard (the guardrails it passed and its output filters), or None
        self.beam_outputs: tuple[Any, ...] | None = None  # a beam request's best hypotheses, once it ended

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
