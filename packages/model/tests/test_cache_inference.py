"""Inference against KV caches: prefill + decode equals the full forward, batching, prefix sharing, errors."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import make_cache
from plyx.specs import CacheFullError

KINDS = ["contiguous", "paged"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_prefill_then_decode_equals_full_forward(kind: str, arch: str, tiny, random_model) -> None:
    extra = {"qwen3": dict(qk_norm=True, head_dim=16), "mistral": dict(sliding_window=3)}.get(arch, {})
    model = random_model(tiny(arch=arch, **extra))
    ids = torch.randint(0, 97, (2, 11))
    full = model(ids)
    cache = make_cache(kind, model.config, batch_size=2, block_size=4)
    outs = [model(ids[:, :4], cache=cache)]
    outs += [model(ids[:, t : t + 1], cache=cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert [cache.length(s) for s in (0, 1)] == [11, 11]


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_of_different_lengths(kind: str, tiny, random_model) -> None:
    model = random_model(tiny())
    prompts = [torch.randint(0, 97, (n,)) for n in (3, 7, 5)]
    conts = [torch.randint(0, 97, (4,)) for _ in prompts]
    cache = make_cache(kind, model.config, batch_size=3, block_size=4)
    T = max(len(p) for p in prompts)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):], mask[r, T - len(p):] = p, 1
    first = model(ids, attention_mask=mask, cache=cache, seq_ids=[10, 11, 12])
    steps = [model(torch.stack([c[t] for c in conts])[:, None], cache=cache, seq_ids=[10, 11, 12]) for t in range(4)]
    for r, p in enumerate(prompts):
        want = model(torch.cat([p, conts[r]])[None])[0]
        torch.testing.assert_close(first[r, T - len(p):], want[: len(p)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([s[r] for s in steps]), want[len(p):], rtol=1e-5, atol=1e-5)
    assert [cache.length(s) for s in (10, 11, 12)] == [7, 11, 9], "padding must not be stored"


def test_prefix_sharing_with_fork(tiny, random_model) -> None:
    """A prompt prefilled once, forked into two continuations, each equal to its own full forward."""
    model = random_model(tiny())
    prompt = torch.randint(0, 97, (1, 9))
    cache = make_cache("paged", model.config, batch_size=3, block_size=4)
    model(prompt, cache=cache, seq_ids=[0])
    used = cache.usage().blocks_used
    cache.fork(0, 1)
    assert cache.usage().blocks_used == used
    a, b = torch.randint(0, 97, (1, 3)), torch.randint(0, 97, (1, 3))
    out_a = model(a, cache=cache, seq_ids=[0])
    out_b = model(b, cache=cache, seq_ids=[1])
    torch.testing.assert_close(out_a, model(torch.cat([prompt, a], 1))[:, 9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_b, model(torch.cat([prompt, b], 1))[:, 9:], rtol=1e-5, atol=1e-5)
    # two full blocks stay shared; the partly filled third is copied once (by seq 0), after
    # which seq 1 owns the original alone and fills it in place
    assert cache.usage().blocks_used == used + 1


def test_cache_full_is_recoverable_mid_generation(tiny, random_model) -> None:
    model = random_model(tiny())
    cache = make_cache("paged", model.config, batch_size=1, block_size=4, num_blocks=3)
    ids = torch.randint(0, 97, (2, 6))
    model(ids[:1], cache=cache, seq_ids=[0])  # 2 blocks
    before = cache.usage()
    with pytest.raises(CacheFullError):
        model(ids[1:], cache=cache, seq_ids=[1])  # needs 2, 1 free
    assert cache.usage() == before and cache.sequences() == [0], "a failed step must not leave a sequence behind"
    cache.evict(0)
    out = model(ids[1:], cache=cache, seq_ids=[1])
    torch.testing.assert_close(out, model(ids[1:]), rtol=1e-5, atol=1e-5)


def test_explicit_positions_and_bad_mask(tiny, random_model) -> None:
    model = random_model(tiny())
    cache = make_cache("contiguous", model.config)
    with pytest.raises(ValueError, match="left padding"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 0, 1]]), cache=cache)
    with pytest.raises(ValueError, match="one id per row"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache, seq_ids=[0])
