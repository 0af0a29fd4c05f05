"""``EngineConfig.kv_cache_dtype`` / ``plyx serve --kv-cache-dtype``: the engine runs on a quantised paged cache,
and a dtype the device cannot run is a startup error naming the fix."""

from __future__ import annotations

import argparse

import pytest
import torch
from plyx.attn import PagedKVCache, QuantizedPagedKVCache
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.specs.errors import ConfigError

from .conftest import small_lm


def _greedy(model, prompt, steps, kind):
    """The oracle: a plain greedy loop over the model with a fresh cache of ``kind`` (no engine)."""
    from plyx.attn import make_cache

    param = next(model.parameters())
    device = param.device
    cache = make_cache(kind, model.config, batch_size=1, block_size=16, max_seq_len=64, device=device,
                       dtype=param.dtype)
    ids, out = torch.tensor([prompt], device=device), []
    with torch.no_grad():
        for _ in range(steps):
            ids = model(ids, cache=cache)[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_engine_decodes_on_a_quantised_cache(kv):
    model = small_lm()
    prompts = [[5, 9, 33, 7, 100, 41, 3], [8, 8, 1, 250, 17]]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    base = Engine(model, config=EngineConfig(max_batch_size=4, num_blocks=64))
    quant = Engine(model, config=EngineConfig(max_batch_size=4, num_blocks=64, kv_cache_dtype=kv))
    assert type(base.cache) is PagedKVCache
    assert isinstance(quant.cache, QuantizedPagedKVCache) and quant.cache.kv_dtype == kv
    # the engine path of the unquantised cache: packed steps (decodes ride in the prefill chunks' forward),
    # attention over the int8/fp8 pools; never a whole sequence dequantised per layer and step (``read``)
    assert quant.packed and base.packed

    def no_read(*a, **k):
        raise AssertionError("the engine dequantised a whole sequence (read) in a step")

    quant.cache.read = no_read
    got = [list(o.outputs[0].token_ids) for o in quant.generate(prompts, params)]
    del quant.cache.read
    # batched, chunked and scheduled by the engine, it decodes what a plain loop over the same cache kind does
    assert got == [_greedy(model, p, 10, f"paged_{kv}") for p in prompts]
    assert quant.cache.bytes_per_block() < 0.75 * base.cache.bytes_per_block()  # head_dim 16 here: (16+4)/64 of f32


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_mixed_step_graph_path_on_a_quantised_cache(kv):
    """Arrivals spread over the run (most steps mix prefill chunks and decodes): the bucketed static step that
    CUDA replays as mixed-step graphs (run eagerly here) decodes what the unpadded packed step does, over the
    quantised pools, and every step takes it."""
    from .test_mixed_graphs import _run_arrivals, prompts_of

    model = small_lm()
    prompts = prompts_of(6, seed=3, lo=10, hi=40)
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    kw = dict(max_batch_size=6, max_batch_tokens=48, block_size=4, num_blocks=120, cuda_graphs=False,
              kv_cache_dtype=kv)
    plain = Engine(model, config=EngineConfig(mixed_graphs=False, **kw))
    bucketed = Engine(model, config=EngineConfig(mixed_graphs=True, **kw))
    assert plain.packed and bucketed.mixed_graphs is not None
    assert _run_arrivals(bucketed, prompts, sp)[0] == _run_arrivals(plain, prompts, sp)[0]
    assert bucketed.mixed_graphs.steps == bucketed.stats.steps


def test_bf16_and_unknown_dtypes():
    model = small_lm()
    engine = Engine(model, config=EngineConfig(max_batch_size=2, num_blocks=32, kv_cache_dtype="bf16"))
    assert engine.cache.kv_pool(0)[0].dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*'int4'.*auto, bf16, int8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")


def test_fp8_on_a_pre_hopper_gpu_is_a_startup_error(monkeypatch):
    from plyx.specs.kvcache import CacheLayout

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    layout = CacheLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype="bfloat16", device="cuda:0",
                         max_seq_len=32, block_size=16, num_blocks=4)
    with pytest.raises(ConfigError, match=r"sm_86.*int8.*EngineConfig.kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e4m3").paged_cache(layout)


def test_cli_option_reaches_the_engine_config():
    from plyx.serve.server import SERVE_COMMAND

    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    assert p.parse_args(["/m"]).kv_cache_dtype == "auto"
    assert p.parse_args(["/m", "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        p.parse_args(["/m", "--kv-cache-dtype", "int4"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels, CUDA graphs)")
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed graph capture warns: here it fails the test
def test_cuda_graph_decode_on_an_int8_cache():
    """On a GPU (bf16, head_dim 64: the Triton kernels) the engine captures and replays decode graphs over the
    int8 cache; its greedy tokens follow the eager loop's (bf16: the fused static step rounds differently, so
    a near tie may flip late tokens; the first ones agree)."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256, max_seq_len=64,
                      init_std=0.5)
    model = TransformerLM(cfg).to("cuda", torch.bfloat16).eval()
    prompts = [[5, 9, 33, 7, 100, 41, 3], [8, 8, 1, 250, 17]]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    engine = Engine(model, config=EngineConfig(max_batch_size=4, num_blocks=64, kv_cache_dtype="int8"))
    got = [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params)]
    assert engine.graphs is not None and engine.graphs.captured, "no decode graph was captured"
    want = [_greedy(model, p, 10, "paged_int8") for p in prompts]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 16
