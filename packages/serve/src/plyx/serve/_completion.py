"""One completion being decoded: its tokens, incremental text, stop rules and finish reason."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from plyx.serve._outputs import CompletionOutput, RequestMetrics, StreamEvent, TokenLogprob
from plyx.serve._params import SamplingParams
from plyx.serve._tokenizer import TokenizerView

__all__ = ["Completion"]


class Completion:
    """Host-side state of one row: what was generated and whether it is finished.

    Args:
        request_index, index: the prompt and which of its ``n`` completions.
        prompt_ids: the prompt's token ids.
        params: its ``SamplingParams``.
        stop_ids: ids that end it (EOS unless ignore_eos, plus ``params.stop_token_ids``).
        context: the model's context length (prompt + generated never exceeds it).
        tokenizer: for text and stop strings, or None.
        seq_id: the row's sequence id in the runner's cache.
        generator: its seeded generator, or None.
        matcher: its xgrammar matcher, or None.
    """

    def __init__(self, *, request_index: int, index: int, prompt_ids: Sequence[int], params: SamplingParams,
                 stop_ids: Sequence[int], context: int, tokenizer: TokenizerView | None, seq_id: int,
                 generator: torch.Generator | None, matcher: Any = None) -> None:
        self.request_index = request_index
        self.index = index
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stop_ids = frozenset(stop_ids)
        self.limit = min(params.max_new_tokens, context - len(prompt_ids))
        self.tokenizer = tokenizer
        self.seq_id = seq_id
        self.generator = generator
        self.matcher = matcher
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""  # final text emitted so far
        self._final_text: str | None = None
        self.model_steps = 0
        self.draft_proposed = 0
        self.draft_accepted = 0
        self._hold = max((len(s) for s in params.stop), default=0)
        # incremental detokenisation (vLLM's): the text of a short window of the newest tokens, so a streamed
        # token costs a few tokens' decode instead of the whole completion's (130 us a row and token at 512
        # tokens with a byte-level BPE: milliseconds per engine step at serving batch sizes)
        self._stable = ""  # the text of token_ids[:_read], built window by window
        self._prefix = 0  # the window starts here: the tokens before it only count through _stable
        self._read = 0
        self._prefix_text = ""  # decode(token_ids[_prefix:_read]): the window's context, already in _stable

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> StreamEvent | None:
        """Take new tokens (stops at the first that finishes the completion); the event to stream, if any."""
        if self.matcher is None and not (self.params.stop and self.tokenizer is not None):
            return self._add_plain(tokens, logprobs)
        return self._add_each(tokens, logprobs)

    def _add_each(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> StreamEvent | None:
        """``add`` token by token: a grammar row's matcher takes each, and a stop string is looked for after each
        (it may end the completion at any of them)."""
        taken: list[int] = []
        taken_lp: list[TokenLogprob] = []
        for j, tok in enumerate(tokens):
            if self.finished:
                break
            self.token_ids.append(int(tok))
            taken.append(int(tok))
            if logprobs is not None and self.logprobs is not None:
                self.logprobs.append(logprobs[j])
                taken_lp.append(logprobs[j])
                self.cumulative_logprob += logprobs[j].logprob
            if self.matcher is not None and not self.matcher.is_terminated():
                self.matcher.accept_token(int(tok))
            if tok in self.stop_ids:
                self.finish_reason, self.stop_reason = "stop", int(tok)
            elif self.matcher is not None and self.matcher.is_terminated():
                self.finish_reason = "stop"  # the grammar accepted its stop token
            elif (self.params.stop and self.tokenizer is not None
                    and len(self.token_ids) >= self.params.min_tokens):  # as vLLM: no stop before min_tokens
                self._check_stop_strings()
            if not self.finished and len(self.token_ids) >= self.limit:
                self.finish_reason = "length"  # a stop on the last allowed token still reports "stop"
        if not taken:
            return None
        delta = self._text_delta()
        return StreamEvent(
            request_index=self.request_index,
            index=self.index,
            token_ids=tuple(taken),
            text=delta,
            logprobs=tuple(taken_lp) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            stop_reason=self.stop_reason,
        )

    def _add_plain(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> StreamEvent | None:
        """``add`` for a completion whose tokens end it only by a stop id or its length (no grammar, no stop
        strings): the cut is found with one scan for the first stop id, not with per-token checks, so a
        multi-step block's row costs a few C-level list operations instead of a Python loop over its tokens."""
        if self.finish_reason is not None or len(tokens) == 0:
            return None
        room = max(1, self.limit - len(self.token_ids))  # (a completion over its limit still takes one token)
        taken = list(map(int, tokens[:room] if room < len(tokens) else tokens))
        if not self.stop_ids.isdisjoint(taken):  # the first stop id ends it, and is taken
            end = next(j for j, tok in enumerate(taken) if tok in self.stop_ids)
            del taken[end + 1:]
            self.finish_reason, self.stop_reason = "stop", taken[end]
        self.token_ids.extend(taken)
        if self.finish_reason is None and len(self.token_ids) >= self.limit:
            self.finish_reason = "length"  # a stop on the last allowed token still reports "stop"
        taken_lp: tuple[TokenLogprob, ...] | None = None
        if self.logprobs is not None:
            taken_lp = tuple(logprobs[:len(taken)]) if logprobs is not None else ()
            self.logprobs.extend(taken_lp)
            for lp in taken_lp:  # summed in token order, as one token at a time would
                self.cumulative_logprob += lp.logprob
        return StreamEvent(
            request_index=self.request_index,
            index=self.index,
            token_ids=tuple(taken),
            text=self._text_delta(),
            logprobs=taken_lp,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            stop_reason=self.stop_reason,
        )

    # -- text ------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int] | None = None) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(self.token_ids if ids is None else ids,
                                     skip_special_tokens=self.params.skip_special_tokens)

    def _current_text(self) -> str:
        """``decode(token_ids)``, from the last window: the window starts one advance back, so a decoder that
        treats a sequence's first token differently (a stripped leading space) sees the same start in the
        window's context text and in the window, and their difference is the new tokens' text."""
        ids = self.token_ids
        new = self._decode(ids[self._prefix:])
        if not new.startswith(self._prefix_text):  # the context decodes differently now: the whole text
            return self._decode()
        tail = new[len(self._prefix_text):]
        if tail.endswith("\ufffd"):  # an incomplete character: the window stays, the caller holds it back
            return self._stable + tail
        self._stable += tail
        context = self._decode(ids[self._read:])
        if context:  # the next window starts at these tokens
            self._prefix, self._prefix_text = self._read, context
        else:  # they decode to nothing (skipped special tokens): an empty context would not stand for them
            self._prefix_text = new
        self._read = len(ids)
        return self._stable

    def _check_stop_strings(self) -> None:
        full = self._decode()
        # only the tail can hold a new match: the last token adds at most its own characters
        start = max(0, len(self.text) - self._hold)
        hits = [(full.find(s, start), s) for s in self.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, s = min(hits)
            self.finish_reason, self.stop_reason = "stop", s
            self._final_text = full[: pos + len(s)] if self.params.include_stop_str_in_output else full[:pos]

    def _text_delta(self) -> str | None:
        if self.tokenizer is None:
            return None
        if self._final_text is not None:
            full = self._final_text
        else:
            full = self._decode() if self.finished else self._current_text()  # the whole text once, at the end
            if not self.finished:
                safe = len(full)
                while safe and full[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence may still change
                    safe -= 1
                hold = 0
                for s in self.params.stop:  # hold back a suffix that may be the start of a stop string
                    for k in range(min(len(s) - 1, safe), 0, -1):
                        if full[safe - k: safe] == s[:k]:
                            hold = max(hold, k)
                            break
                safe -= hold
                full = full[:safe]
        if not full.startswith(self.text):  # decoding changed earlier characters: emit nothing new
            return ""
        delta, self.text = full[len(self.text):], full
        return delta

    # -- result ------------------------------------------------------------------------
    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            token_ids=tuple(self.token_ids),
            text=self.text if self.tokenizer is not None else None,
            finish_reason=self.finish_reason or "length",  # type: ignore[arg-type]
            stop_reason=self.stop_reason,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            metrics=RequestMetrics(
                num_generated=len(self.token_ids),
                model_steps=self.model_steps,
                draft_proposed=self.draft_proposed,
                draft_accepted=self.draft_accepted,
            ),
        )
