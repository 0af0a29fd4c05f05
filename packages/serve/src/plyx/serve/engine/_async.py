"""``AsyncEngine``: the engine on its own thread, fed and read from asyncio.

The engine's state is touched only by its thread: requests and aborts reach it
through a queue and are applied between two steps, outputs go back to each
request's ``RequestStream`` through ``loop.call_soon_threadsafe``. Torch releases
the GIL inside its kernels, so the event loop keeps answering (``/health``,
new connections) while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

from plyx.serve._params import BeamSearchParams, SamplingParams
from plyx.serve.engine._engine import Engine, EngineOutput
from plyx.serve.engine._guard import RequestGuard

__all__ = ["AsyncEngine", "RequestStream"]

log = logging.getLogger("plyx.serve.engine")

class RequestStream:
    """The outputs of one request, as an async iterator of ``EngineOutput`` (or ``next_batch()``, all ready ones).

    Iteration ends after the output with ``request_finished`` (or ``aborted``); an engine failure is raised.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        # a deque and one waiter future instead of an asyncio.Queue: this is touched once per token and
        # stream, and the queue's getter bookkeeping costs the event loop (which shares the GIL with the
        # engine thread) several times more
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._last_out = False  # the finishing output was handed out: the next read ends the stream
        self.finished = False
        self.created = time.monotonic()

    def _push(self, items: list[Any]) -> None:  # on the event loop
        self._items.extend(items)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _take(self) -> Any:
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.request_finished:
            self._last_out = True
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._last_out:
            self.finished = True
        if self.finished:
            raise StopAsyncIteration
        if not self._items:
            await self._wait()
        return self._take()

    async def next_batch(self) -> list[EngineOutput]:
        """Every output ready now, in order (waits for the first); ``[]`` once the stream ended.

        A reader that fell a few steps behind gets them in one go, and can answer them with one write.
        """
        if self._last_out:
            self.finished = True
        if self.finished:
            return []
        if not self._items:
            await self._wait()
        batch = [self._take()]
        while self._items and not self._last_out:
            if isinstance(self._items[0], BaseException):
                break  # raised by the next call, after this batch was handled
            batch.append(self._take())
        return batch


def _push_all(batch: list[tuple[RequestStream, list[Any]]]) -> None:
    for stream, items in batch:
        stream._push(items)


class AsyncEngine:
    """Runs an ``Engine`` on a background thread.

    Args:
        engine: the engine (owned by the thread from ``start()`` on).

    Example::

        aengine = AsyncEngine(engine).start()
        stream = await aengine.add("r1", prompt_ids, SamplingParams(max_new_tokens=16))
        async for out in stream:
            print(out.event.text)
        await aengine.shutdown()
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.accepting = True
        self.error: BaseException | None = None
        self.step_seconds = 0.0  # wall time the thread spent in Engine.step (its mean is the step time TPOT pays)

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="plyx-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the event-loop side ---------------------------------------------------------------
    async def add(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams | BeamSearchParams, *,
                  adapter: str | None = None, guard: RequestGuard | None = None) -> RequestStream:
        """Queue a request and wait until the engine took it; raises what ``Engine.add_request`` raises.

        ``guard``: the caller's guardrails (a server's, shared by the prompts of one API call); None: the engine
        makes one per request (``Engine.add_request``)."""
        loop = asyncio.get_running_loop()
        grammar = None
        if getattr(params, "structured", None) is not None:  # BeamSearchParams has none; compiling may take a while: not on the loop, not on the engine
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params)
        stream = RequestStream(request_id, loop)
        ack: asyncio.Future[None] = loop.create_future()
        self._inbox.put(("add", request_id, list(prompt_ids), params, grammar, stream, ack, adapter, guard))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the engine thread between two steps (no forward runs meanwhile: adapters can be
        loaded and unloaded safely); its result, or its exception raised here."""
        if not self.alive:
            return fn()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        return await fut

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); its blocks are freed before the next step. Thread-safe."""
        self._inbox.put(("abort", request_id))

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; wait up to ``timeout`` s for in-flight requests; True when all finished."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.engine.has_unfinished()

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Finish in-flight requests for up to ``timeout`` s, abort the rest (their streams end), stop the thread."""
        await self.drain(timeout)
        self._inbox.put(("abort_all",))
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # -- the engine thread ---------------------------------------------------------------
    def _deliver(self, stream: RequestStream, items: list[Any]) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream._push, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _resolve(self, stream: RequestStream, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        def set_result() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

        try:
            stream.loop.call_soon_threadsafe(set_result)
        except RuntimeError:
            pass

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, grammar, stream, ack, adapter, guard = cmd
            try:
                self.engine.add_request(rid, prompt, params, grammar=grammar, arrival=stream.created, adapter=adapter,
                                        guard=guard)
            except Exception as exc:  # a bad request never stops the engine
                self._resolve(stream, ack, exc)
                return
            self._streams[rid] = stream
            self._resolve(stream, ack, None)
        elif kind == "abort":
            outs = self.engine.abort(cmd[1])
            stream = self._streams.pop(cmd[1], None)
            if stream is not None and outs:
                self._deliver(stream, outs)
        elif kind == "call":
            _, fn, loop, fut = cmd
            try:
                result, error = fn(), None
            except Exception as exc:  # handed to the caller; the engine goes on
                result, error = None, exc

            def settle() -> None:
                if not fut.done():
                    fut.set_exception(error) if error is not None else fut.set_result(result)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the caller's loop is closed
                pass
        elif kind == "abort_all":
            for rid in list(self.engine.requests):
                self._handle(("abort", rid))

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """One wake-up of each event loop per step, whatever the number of requests (each
        ``call_soon_threadsafe`` writes to the loop's self-pipe and costs the loop a turn)."""
        grouped: dict[str, list[EngineOutput]] = {}
        for out in outputs:
            grouped.setdefault(out.request_id, []).append(out)
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, list[Any]]]] = {}
        for rid, items in grouped.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if any(o.request_finished for o in items):
                self._streams.pop(rid, None)
            per_loop.setdefault(stream.loop, []).append((stream, items))
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_push_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed (a bug, or the device): end every request with the error and keep serving."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._deliver(stream, [exc])

    def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                if self._stop.is_set():
                    return
                self._handle(self._inbox.get())  # idle: sleep until a request (or the stop) arrives
            while True:  # apply every queued request and abort between two steps
                try:
                    self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not self.engine.has_unfinished():
                continue
            steps = self.engine.stats.steps
            try:
                t0 = time.perf_counter()
                outputs = self.engine.step()
                self.step_seconds += time.perf_counter() - t0
                if self.engine.stats.steps == steps:  # nothing could be scheduled: wait for news, do not spin
                    with contextlib.suppress(queue.Empty):
                        self._handle(self._inbox.get(timeout=0.005))
            except Exception as exc:
                log.exception("engine step failed")
                self.error = exc
                self._fail_all(RuntimeError(f"the engine failed while running this request: {exc}"))
                continue
            self._dispatch(outputs)
