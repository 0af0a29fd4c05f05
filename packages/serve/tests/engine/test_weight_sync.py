"""``sync_weights``: a running engine takes another model's weights in place and then generates as that model."""

from __future__ import annotations

import copy

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig, sync_weights

from .conftest import small_lm


def _greedy(engine, prompts):
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    return [o.outputs[0].token_ids for o in outs]


def test_synced_engine_generates_as_the_source_and_drops_stale_prefix_blocks():
    old, new = small_lm(seed=0), small_lm(seed=1)
    prompts = [list(range(3, 40)), list(range(5, 25))]  # 37 tokens: two full blocks enter the prefix cache
    engine = Engine(copy.deepcopy(old), config=EngineConfig(block_size=16, num_blocks=64))
    before = _greedy(engine, prompts)
    assert len(engine.prefix) > 0
    storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    seconds = sync_weights(engine, new)
    assert seconds >= 0 and len(engine.prefix) == 0  # blocks of the old weights are gone
    # in place: the engine's tensors keep their storage (CUDA graphs and packed buffers stay valid)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == storage
    for (n, p), q in zip(engine.model.named_parameters(), new.parameters()):
        assert torch.equal(p, q), n
    after = _greedy(engine, prompts)
    assert after == _greedy(Engine(copy.deepcopy(new), config=EngineConfig(block_size=16, num_blocks=64)), prompts)
    assert after != before


def test_sync_refuses_a_busy_engine_and_another_architecture():
    engine = Engine(small_lm(seed=0), config=EngineConfig(block_size=16, num_blocks=64))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="idle engine"):
        sync_weights(engine, small_lm(seed=1))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="shapes differ"):
        sync_weights(engine, small_lm(vocab=512))
