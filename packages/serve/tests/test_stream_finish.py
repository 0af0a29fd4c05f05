"""A streamed reply that reads several engine outputs at once still marks only the last chunk finished."""

from __future__ import annotations

from plyx.serve import SamplingParams
from plyx.serve._outputs import StreamEvent
from plyx.serve.engine import EngineOutput
from plyx.serve.server._generation import Job


def test_each_event_carries_the_finish_reason_it_set():
    job = Job(aengine=None, prompts=[[1, 2]], params=SamplingParams(max_new_tokens=3), guard=None,
              kind="completion")
    outs = [EngineOutput(f"{job.id}-0", 0, StreamEvent(request_index=0, index=0, token_ids=(t,), text=w,
                                                       finish_reason="length" if last else None))
            for t, w, last in ((5, "a", False), (6, "b", False), (7, "c", True))]
    events = [ev for out in outs for ev in job._apply(0, out)]  # applied together, as a batch is
    assert [ev[3] for ev in events] == [None, None, "length"]
    assert [ev[1] for ev in events] == ["a", "b", "c"]
    assert job.choices[0].finish_reason == "length"
