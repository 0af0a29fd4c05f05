"""Shared setup of plyx-rl's tests: one torch thread.

The models here are tiny (32-64 wide); on a shared 2-core machine a second intra-op thread only spins
on the contended core and makes each step several times slower.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
