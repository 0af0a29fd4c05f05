"""The progress display: an ETA that a slow step does not swing, and nanoGPT-style log lines."""

from __future__ import annotations

import io

from plyx.train._progress import StepTimer, format_log_line, use_bar


def test_eta_is_smoothed_against_a_slow_step() -> None:
    timer = StepTimer(alpha=0.1)
    assert timer.eta(10) is None
    for _ in range(50):
        timer.update(0.040)
    steady = timer.eta(1000)
    assert abs(steady - 40.0) < 1e-6
    timer.update(0.200)  # one step 5x slower (a loaded machine)
    assert timer.eta(1000) < steady * 1.5  # rich's per-window speed would jump ~5x here
    for _ in range(100):
        timer.update(0.080)  # a lasting slowdown is followed
    assert abs(timer.eta(1000) - 80.0) < 1.0


def test_log_line_format() -> None:
    line = format_log_line(120, {"loss": 2.31, "lr": 1.2e-3, "ms_per_step": 41.2, "tokens_per_s": 25_100.0,
                                 "mfu": 0.31}, eta=130)
    assert line == "step 120 | loss 2.3100 | lr 1.20e-03 | 41 ms | 25.1k tok/s | mfu 31% | eta 0:02:10"
    assert format_log_line(3, {"loss": 1.0}) == "step 3 | loss 1.0000"
    shared = format_log_line(4, {"loss": 1.0, "tokens_per_s": 900.0, "allreduce_share": 0.125})
    assert shared == "step 4 | loss 1.0000 | 900 tok/s | comm 12%"


def test_bar_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_bar(True, Tty()) and not use_bar(False, Tty())
    assert not use_bar(True, io.StringIO())


def test_the_bar_shows_throughput(monkeypatch, prepared, tmp_path, tiny_config) -> None:
    """On a terminal the bar carries ms/step and tok/s beside the loss (they used to be in metrics.csv only)."""
    from plyx.train import Trainer, TrainOptions, _progress

    seen: list[str] = []
    real = _progress.progress_bar

    def spy(total, start, timer):
        with real(total, start, timer) as bar:
            original = bar.update

            def update(task, **fields):
                if "speed" in fields:
                    seen.append(fields["speed"])
                return original(task, **fields)

            bar.update = update
            yield bar

    import contextlib

    monkeypatch.setattr("plyx.train._trainer.progress_bar", contextlib.contextmanager(spy))
    monkeypatch.setattr("plyx.train._trainer.use_bar", lambda progress: progress)  # as if on a terminal
    cfg = tiny_config(prepared, tmp_path / "run", steps=4, log_every=2, eval_every=0, checkpoint_every=0)
    Trainer(cfg, options=TrainOptions(tensorboard=False, handle_signals=False)).fit()
    assert len(seen) == 2 and all(" ms | " in s and "tok/s" in s for s in seen), seen
