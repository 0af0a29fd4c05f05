"""How much of a rank's wall time has a collective in flight (``allreduce_share`` in metrics.csv).

Two measures, one meaning (the fraction of wall time during which at least one collective was
running, overlap with compute included: 0.3 means collectives were in flight 30% of the time,
not that they cost 30%):

- DDP (``CommClock``): its communication hook times every gradient bucket's all-reduce from
  launch to the completion of its future, over the whole window between two log lines.
- FSDP, HSDP, FSDP + TP (``CommSampler``): FSDP2 issues its all-gathers and reduce-scatters (and
  DTensor its TP all-reduces) itself, with no hook that sees them complete, so one step per log
  window runs under ``torch.profiler``: on CPU the spans of gloo's collectives in its worker
  threads (``gloo:all_gather``, ``gloo:all_reduce``...), on CUDA the NCCL kernels on the device.
  Their union over the step's wall time is the share. Cheap: one step in ``log_every`` is
  profiled, with CUDA activity only on GPUs (no per-operator CPU recording there); the first
  window's sample is the run's first step (warm-up included).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["CommClock", "CommSampler", "timed_allreduce", "union_seconds"]


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping collectives count once)."""
    busy, cursor = 0.0, float("-inf")
    for start, end in sorted(spans):
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    return busy


class CommSampler:
    """The collective share of one profiled step per measuring window (see the module docstring).

    Args:
        cuda: NCCL on CUDA devices (profile device kernels), else gloo on CPU (profile its worker threads).
    """

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda
        self._profiler: Any = None
        self._t0 = 0.0
        self._want = True  # sample the next step that starts
        self._last = 0.0
        self.failed = False  # the profiler could not run here: the share is unknown (NaN)

    def step_started(self) -> None:
        """A step begins: close a running sample (its step is over); open one when a sample is wanted."""
        if self._profiler is not None:
            self._finish()
        if self._want and not self.failed:
            self._want = False
            try:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
            except Exception as exc:  # noqa: BLE001 - a profiler that cannot start must not stop the training
                self._fail(exc)
                return
            self._t0 = time.perf_counter()

    def share(self) -> float:
        """The share of the latest sample (a sample still running ends now), NaN when the profiler failed;
        the next step is sampled."""
        if self._profiler is not None:
            self._finish()
        self._want = True
        return float("nan") if self.failed else self._last

    def _fail(self, exc: BaseException) -> None:
        import warnings

        self.failed, self._profiler = True, None
        warnings.warn(f"plyx-dist: torch.profiler failed ({exc}); allreduce_share is NaN for the rest of the run",
                      RuntimeWarning, stacklevel=3)

    def _finish(self) -> None:
        try:
            self._measure()
        except Exception as exc:  # noqa: BLE001 - see step_started
            self._fail(exc)

    def _measure(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()  # the step's kernels have run before the trace is read
        wall = time.perf_counter() - self._t0
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        spans = []
        for event in profiler.profiler.kineto_results.events():
            name = event.name()
            if self.cuda:  # NCCL's kernels on the device (ncclDevKernel_AllGather_RING_LL...)
                collective = "nccl" in name.lower() and str(event.device_type()).endswith("CUDA")
            else:  # gloo's spans in its worker threads (gloo:all_gather, gloo:all_reduce...)
                collective = name.startswith("gloo:")
            if collective:
                start = event.start_ns() * 1e-9
                spans.append((start, start + event.duration_ns() * 1e-9))
        self._last = min(union_seconds(spans) / wall, 1.0) if wall > 0 else 0.0


class CommClock:
    """Union of the intervals during which a DDP bucket's all-reduce was in flight, per measuring window."""

    def __init__(self) -> None:
        self.group: Any = None  # the data-parallel process group (set by ``wrap``)
        self.window_start = time.perf_counter()
        self.intervals: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self.lock:
            self.intervals.append((start, end))

    def share(self) -> float:
        now = time.perf_counter()
        with self.lock:
            spans, self.intervals = sorted(self.intervals), []
        busy = union_seconds([(max(start, self.window_start), end) for start, end in spans])
        wall, self.window_start = now - self.window_start, now
        return busy / wall if wall > 0 else 0.0


def timed_allreduce(clock, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
    """torch's default DDP hook (``allreduce_hook``), timed from launch to completion."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    start = time.perf_counter()
    future = allreduce_hook(clock.group, bucket)

    def done(fut: Any) -> Any:
        clock.add(start, time.perf_counter())
        return fut.value()

    return future.then(done)
