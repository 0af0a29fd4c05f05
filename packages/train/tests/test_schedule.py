from __future__ import annotations

import math

import pytest
import torch
from plyx.specs import ScheduleConfig
from plyx.train import build_scheduler, lr_multiplier


def test_warmup_then_cosine_matches_nanogpt() -> None:
    cfg = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    lr, min_lr, total = 1e-3, 1e-4, 100

    def nanogpt(it: int) -> float:  # nanoGPT train.py get_lr
        if it < 10:
            return lr * (it + 1) / (10 + 1)
        if it > total:
            return min_lr
        ratio = (it - 10) / (total - 10)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    for step in [0, 5, 9, 10, 11, 50, 99, 100, 150]:
        assert lr * lr_multiplier(step, cfg, total) == pytest.approx(nanogpt(step), rel=1e-12)


def test_linear_wsd_constant() -> None:
    lin = ScheduleConfig(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_multiplier(s, lin, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    wsd = ScheduleConfig(kind="wsd", warmup_steps=2, min_lr_ratio=0.0, decay_fraction=0.25)
    values = [lr_multiplier(s, wsd, 20) for s in range(21)]
    assert values[:2] == [1 / 3, 2 / 3]
    assert all(v == 1.0 for v in values[2:15])  # stable until the last 25 % (5 steps)
    assert values[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    const = ScheduleConfig(kind="constant", warmup_steps=3)
    assert [lr_multiplier(s, const, 10) for s in (0, 2, 3, 9, 50)] == [0.25, 0.75, 1.0, 1.0, 1.0]


def test_scheduler_state_round_trips() -> None:
    cfg = ScheduleConfig(kind="cosine", warmup_steps=3)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, cfg, 20)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    sched2 = build_scheduler(opt2, cfg, 20)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr() == [0.5 * lr_multiplier(7, cfg, 20)]
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
