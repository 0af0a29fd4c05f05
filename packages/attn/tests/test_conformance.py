"""Every KV-cache kind the plugins provide passes the plyx-specs conformance kit."""

from __future__ import annotations

import pytest
from plyx.attn import cache_kinds
from plyx.specs.kvcache import CacheLayout
from plyx.specs.testing.kvcache import CHECKS, check_kvcache, default_layout

KINDS = sorted(cache_kinds())


def test_builtin_kinds_are_registered() -> None:
    kinds = cache_kinds()
    assert {"contiguous", "paged"} <= set(kinds)
    assert kinds["paged"].source.startswith("plyx-attn")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", KINDS)
def test_conformance(kind: str, check) -> None:
    check(cache_kinds()[kind].factory)


@pytest.mark.parametrize("kind", KINDS)
def test_conformance_other_geometry(kind: str) -> None:
    # odd sizes: 1 KV head (MQA), block of 3, sequences that end mid-block
    layout = CacheLayout(num_layers=3, num_kv_heads=1, head_dim=6, dtype="float32", device="cpu",
                         max_seq_len=13, block_size=3, num_blocks=17)
    assert len(check_kvcache(cache_kinds()[kind].factory, layout)) == len(CHECKS)


def test_the_kit_catches_a_broken_cache() -> None:
    """A cache whose fork aliases instead of copying on write must fail the kit."""
    from plyx.attn import ContiguousKVCache

    class Aliasing(ContiguousKVCache):
        def fork(self, src: int, dst: int) -> None:  # shares the row: writes leak
            self._rows[dst] = self._rows[src]
            self._lens[dst] = self._lens[src]

    with pytest.raises(AssertionError):
        check_kvcache(lambda layout: Aliasing(layout, max_batch=3), default_layout())
