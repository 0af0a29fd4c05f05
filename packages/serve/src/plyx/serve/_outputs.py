"""What ``generate()`` returns and what ``stream_generate()`` yields (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "StreamEvent", "TokenLogprob"]

FinishReason = Literal["stop", "length", "content_filter"]


class TokenLogprob(msgspec.Struct, frozen=True):
    """Log-probability of one generated token and its most likely alternatives.

    Attributes:
        token_id: the generated token.
        logprob: its log-probability under the model's (unprocessed) distribution.
        top: ``(token_id, logprob)`` of the most likely tokens, best first (``SamplingParams.logprobs`` many).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestMetrics(msgspec.Struct, frozen=True):
    """Counters of one completion.

    Attributes:
        num_generated: tokens generated.
        model_steps: verification or decode forward passes of the target model for this completion.
        draft_proposed: tokens proposed by the draft model (speculative decoding; 0 otherwise).
        draft_accepted: of those, tokens the target accepted.
    """

    num_generated: int = 0
    model_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None without speculative decoding."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Tokens produced per target verification step (accepted drafts + the target's own token)."""
        return self.num_generated / self.model_steps if self.draft_proposed and self.model_steps else None


class CompletionOutput(msgspec.Struct, frozen=True):
    """One completion of a prompt.

    Attributes:
        index: which of the ``n`` completions (or beam rank, best first).
        token_ids: generated ids; a stop token id that ended it is included (as transformers does).
        text: the decoded text (None without a tokenizer); stop strings are cut unless asked otherwise.
        finish_reason: ``stop`` (EOS, a stop id, a stop string, or a finished grammar) or ``length``
            (max_new_tokens or the model's context).
        stop_reason: the stop token id or stop string that ended it; None otherwise.
        logprobs: per generated token, when asked for.
        cumulative_logprob: sum of the chosen tokens' log-probabilities (when logprobs were asked, or beam score
            inputs); beam search puts the length-penalised score in ``score``.
        score: beam search's length-penalised score; None for sampling.
        metrics: counters (speculative acceptance among them).
    """

    index: int
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    cumulative_logprob: float | None = None
    score: float | None = None
    metrics: RequestMetrics = RequestMetrics()


class RequestOutput(msgspec.Struct, frozen=True):
    """All completions of one prompt, in the order prompts were given.

    Attributes:
        request_index: position of the prompt in the ``prompts`` argument.
        prompt: the prompt text when it was given as text, else None.
        prompt_token_ids: the prompt's ids.
        outputs: ``n`` completions (or ``num_return_sequences`` beams, best first).
    """

    request_index: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]


class StreamEvent(msgspec.Struct, frozen=True):
    """New tokens of one completion, as ``stream_generate()`` produces them.

    Attributes:
        request_index, index: which prompt and which of its ``n`` completions.
        token_ids: tokens produced since the last event (several per step with speculative decoding).
        text: text that became final since the last event ('' while held back: an incomplete UTF-8
            character or a possible stop-string prefix); None without a tokenizer.
        logprobs: per new token, when asked for.
        finish_reason: None until the completion's last event.
        stop_reason: as ``CompletionOutput.stop_reason`` on the last event.
    """

    request_index: int
    index: int
    token_ids: tuple[int, ...]
    text: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
