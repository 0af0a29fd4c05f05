"""One API request in flight: its engine requests, per-choice text (through the output rails the engine
applies), and the OpenAI response bodies (whole, or as server-sent-event chunks)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from plyx.serve._outputs import TokenLogprob
from plyx.serve._params import BeamSearchParams, SamplingParams
from plyx.serve.engine import AsyncEngine, EngineOutput, RequestGuard, RequestStream

__all__ = ["Choice", "Job", "new_job_id"]


#: one streamed piece of a choice: (choice, new text, its log-probs, the finish reason this event set or None).
#: The finish reason travels with the event: a batch of several events read together must not show the
#: choice's final state on every chunk.
Event = tuple["Choice", str, list[TokenLogprob], "str | None"]


class Choice:
    """One returned choice: prompt ``p``'s completion ``i``, its text (as the engine's output rails let it out),
    and its logprobs."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.started = False  # chat: the role delta was sent


def new_job_id(kind: str) -> str:
    """The response id of an API call (``chatcmpl-...`` or ``cmpl-...``, as OpenAI's)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


class Job:
    """The engine requests of one API call (one per prompt) and their choices (``prompt * n + index``).

    Args:
        aengine: the engine. prompts: token ids per prompt. params: the sampling parameters.
        guard: the call's guardrails (``RequestGuard``, admitted already): the engine runs its output rails on
            every choice and reports the response when the last prompt ended. None: the engine guards each
            prompt on its own.
        adapter: the resident LoRA adapter the request runs through (None: the base model).
        keep: the choices returned per prompt when more are computed (``best_of`` samples: the ``keep`` of highest
            cumulative log-probability, ``returned``); None: all.
        show_logprobs: whether the answer carries log-probabilities (default: when ``params`` asks for them).
    """

    def __init__(self, aengine: AsyncEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 guard: RequestGuard | None, kind: str, job_id: str | None = None, adapter: str | None = None,
                 keep: int | None = None, show_logprobs: bool | None = None) -> None:
        self.aengine = aengine
        self.prompts = [list(p) for p in prompts]
        self.params = params
        beams = isinstance(params, BeamSearchParams)
        self.n = params.num_return_sequences if beams else params.n  # choices each prompt's request emits
        self.keep = keep
        self.show_logprobs = (params.logprobs if beams else params.logprobs is not None) if show_logprobs is None \
            else show_logprobs
        self.adapter = adapter  # the resident LoRA adapter the request named (None: the base model)
        self.id = job_id or new_job_id(kind)
        self.created = int(time.time())
        self.guard = guard
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.streams: list[RequestStream] = []
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.finished_at: float | None = None
        self.done = False

    async def start(self) -> None:
        """Queue every prompt; on failure the ones already queued are aborted."""
        try:
            for p, ids in enumerate(self.prompts):
                self.streams.append(await self.aengine.add(f"{self.id}-{p}", ids, self.params, adapter=self.adapter,
                                                           guard=self.guard))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self.done:
            for s in self.streams:
                self.aengine.abort(s.request_id)

    async def events(self) -> AsyncIterator[Event]:
        """(choice, new text, new logprobs) as tokens arrive; the last event of a choice has its finish_reason."""
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events of ``events()``, grouped: every event ready now (a streaming reply writes each group at
        once, so a reader that fell behind the engine catches up with one socket write, not one per token)."""
        if len(self.streams) == 1:  # the common case: read the one stream directly, no relay task
            async for batch in self._single():
                yield batch
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((p, out))
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait((p, None))

        tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(self.streams)]
        open_streams = len(tasks)
        try:
            while open_streams:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, Exception):
                        if batch:
                            yield batch
                        raise item
                    p, out = item
                    if out is None:
                        open_streams -= 1
                        continue
                    batch.extend(self._apply(p, out))
                if batch:
                    yield batch
            self.done = True
            self.finished_at = time.monotonic()
        finally:
            for t in tasks:
                t.cancel()
            if not self.done:
                self.abort()

    async def _single(self) -> AsyncIterator[list[Event]]:
        stream = self.streams[0]
        try:
            while outs := await stream.next_batch():
                batch = [ev for out in outs for ev in self._apply(0, out)]
                if batch:
                    yield batch
            self.done = True
            self.finished_at = time.monotonic()
        finally:
            if not self.done:
                self.abort()

    def _apply(self, p: int, out: EngineOutput) -> list[Event]:
        choice = self.choices[p * self.n + out.index]
        if choice.finish_reason is not None:
            return []
        if out.aborted:
            events = []
            for c in self.choices[p * self.n:(p + 1) * self.n]:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    events.append((c, "", [], "abort"))
            return events
        ev = out.event
        assert ev is not None
        if ev.token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        choice.token_ids.extend(ev.token_ids)
        new_lp = list(ev.logprobs or ())
        choice.logprobs.extend(new_lp)
        text = ev.text or ""  # through the output rails already (the engine ends a blocked choice: content_filter)
        if ev.finish_reason is not None:
            choice.finish_reason = ev.finish_reason
        choice.text += text
        return [(choice, text, new_lp, choice.finish_reason)]

    def returned(self) -> list[Choice]:
        """The choices the answer carries: all, or per prompt the ``keep`` of highest cumulative log-probability
        (``best_of`` sampling), best first, renumbered ``prompt * keep + rank``."""
        if self.keep is None or self.keep >= self.n:
            return self.choices
        out = []
        for p in range(len(self.prompts)):
            group = self.choices[p * self.n:(p + 1) * self.n]
            ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))  # stable: index on ties
            for rank, c in enumerate(ranked[:self.keep]):
                c.index = p * self.keep + rank
                out.append(c)
        return out

    def usage(self) -> dict[str, int]:
        """Tokens of every choice computed: all ``best_of`` samples (as OpenAI bills them); a beam search's returned
        hypotheses."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- response bodies ------------------------------------------------------------------------
def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_text(tokenizer, lp.token_id)
        tokens.append(s)
        values.append(lp.logprob)
        tops.append({token_text(tokenizer, t): v for t, v in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""

    def entry(tid: int, value: float) -> dict[str, Any]:
        s = token_text(tokenizer, tid)
        return {"token": s, "logprob": value, "bytes": list(s.encode("utf-8"))}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
    ]}


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
