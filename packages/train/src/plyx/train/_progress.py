"""What a run shows while it trains: a rich bar with a smoothed ETA on a terminal, nanoGPT-style lines elsewhere.

On a terminal the bar's time-remaining comes from an exponential moving
average of the step time, so one slow step on a loaded machine does not swing
the estimate (rich's own column divides by a short, noisy speed window). When
the output is a pipe or a file, or ``--no-progress`` is given, every
``log_every`` steps print one line::

    step 120 | loss 2.3100 | lr 1.20e-03 | 41 ms | 25.1k tok/s | mfu 31% | eta 0:02:10
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["StepTimer", "format_log_line", "format_speed", "progress_bar", "use_bar"]


class StepTimer:
    """EMA of seconds per step, and the time left at that pace.

    Args:
        alpha: weight of the newest step (0.1: about the last 10 steps count).
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.seconds: float | None = None

    def update(self, seconds: float) -> float:
        """Fold in one step's duration; returns the smoothed seconds per step."""
        self.seconds = seconds if self.seconds is None else self.alpha * seconds + (1 - self.alpha) * self.seconds
        return self.seconds

    def eta(self, steps_left: int) -> float | None:
        """Seconds left for ``steps_left`` steps at the smoothed pace (None before the first step)."""
        return None if self.seconds is None else max(0, steps_left) * self.seconds


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(datetime.timedelta(seconds=int(seconds)))


def format_speed(metrics: Mapping[str, float]) -> str:
    """``41 ms | 25.1k tok/s | mfu 31% | comm 12%`` of a logged step's metrics (the bar shows it beside the loss)."""
    parts = []
    if "ms_per_step" in metrics:
        parts.append(f"{metrics['ms_per_step']:.0f} ms")
    if "tokens_per_s" in metrics:
        parts.append(f"{_si(metrics['tokens_per_s'])} tok/s")
    if "mfu" in metrics:
        parts.append(f"mfu {metrics['mfu'] * 100:.0f}%")
    share = metrics.get("allreduce_share")
    if share is not None and share == share:  # distributed runs: wall time with a collective in flight (NaN: unknown)
        parts.append(f"comm {metrics['allreduce_share'] * 100:.0f}%")
    return " | ".join(parts)


def format_log_line(step: int, metrics: Mapping[str, float], eta: float | None = None) -> str:
    """``step 120 | loss 2.3100 | lr 1.20e-03 | 41 ms | 25.1k tok/s | mfu 31% | eta 0:02:10`` (fields present only).

    Args:
        step: the completed optimizer step.
        metrics: the step's metrics (``loss``, ``lr``, ``ms_per_step``, ``tokens_per_s``, ``mfu``).
        eta: seconds left, if known.

    Returns:
        the line.
    """
    parts = [f"step {step}"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    if "lr" in metrics:
        parts.append(f"lr {metrics['lr']:.2e}")
    speed = format_speed(metrics)
    if speed:
        parts.append(speed)
    if eta is not None:
        parts.append(f"eta {_clock(eta)}")
    return " | ".join(parts)


def use_bar(progress: bool, stream: Any = None) -> bool:
    """The bar only when asked for and the output is a terminal (a pipe or a file gets log lines)."""
    stream = sys.stdout if stream is None else stream
    return bool(progress) and bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def progress_bar(total: int, start: int, timer: StepTimer) -> Iterator[Any]:
    """A rich ``Progress`` with one ``train`` task and an ETA column fed by ``timer``.

    Args:
        total: the run's steps.
        start: the step it starts (or resumes) at.
        timer: the step-time EMA the ETA column reads.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class SmoothedEta(ProgressColumn):
        """Time left at the EMA pace of ``timer`` (refreshed with the bar)."""

        def render(self, task: Any) -> Text:
            return Text(_clock(timer.eta(int(task.total - task.completed))), style="progress.remaining")

    with Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"), SmoothedEta(),
    ) as progress:
        progress.add_task("train", total=total, completed=start, loss="-", speed="")
        yield progress
