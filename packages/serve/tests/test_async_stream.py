"""``RequestStream``: per-item iteration and ``next_batch()`` (all ready outputs at once) keep order, end after
the finishing output and raise an engine failure after the outputs that came before it."""

from __future__ import annotations

import asyncio

import pytest
from plyx.serve._outputs import StreamEvent
from plyx.serve.engine import EngineOutput, RequestStream


def _out(i: int, *, last: bool = False) -> EngineOutput:
    return EngineOutput("r", 0, StreamEvent(0, 0, (i,), str(i), finish_reason="length" if last else None),
                        request_finished=last)


def _run(coro):
    return asyncio.run(coro)


def test_iteration_waits_for_pushes_and_ends_after_the_finishing_output():
    async def go():
        stream = RequestStream("r", asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stream._push, [_out(0), _out(1)])
        loop.call_later(0.02, stream._push, [_out(2, last=True), _out(99)])  # nothing after the last is read
        got = [out.event.token_ids[0] async for out in stream]
        return got, stream.finished

    assert _run(go()) == ([0, 1, 2], True)


def test_next_batch_returns_every_ready_output_and_stops_at_the_finishing_one():
    async def go():
        stream = RequestStream("r", asyncio.get_running_loop())
        stream._push([_out(0), _out(1), _out(2)])
        first = await stream.next_batch()
        stream._push([_out(3), _out(4, last=True)])
        second = await stream.next_batch()
        third = await stream.next_batch()
        return [[o.event.token_ids[0] for o in b] for b in (first, second, third)], stream.finished

    assert _run(go()) == ([[0, 1, 2], [3, 4], []], True)


def test_next_batch_hands_out_outputs_before_an_engine_failure_then_raises_it():
    async def go():
        stream = RequestStream("r", asyncio.get_running_loop())
        stream._push([_out(0), RuntimeError("the engine failed"), _out(1)])
        first = await stream.next_batch()
        with pytest.raises(RuntimeError, match="the engine failed"):
            await stream.next_batch()
        return [o.event.token_ids[0] for o in first], await stream.next_batch(), stream.finished

    assert _run(go()) == ([0], [], True)


def test_a_waiting_reader_wakes_on_a_push_from_another_thread():
    async def go():
        loop = asyncio.get_running_loop()
        stream = RequestStream("r", loop)
        # as AsyncEngine delivers: call_soon_threadsafe from its own thread
        loop.run_in_executor(None, lambda: loop.call_soon_threadsafe(stream._push, [_out(7, last=True)]))
        return [o.event.token_ids[0] for o in await asyncio.wait_for(stream.next_batch(), 5)]

    assert _run(go()) == [7]
