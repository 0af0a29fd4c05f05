"""Multi-LoRA: the gathered update against a float64 per-row reference, a step mixing adapters and the base
equal to each request run alone on its merged model, and adapters that do not fit named at load time."""

from __future__ import annotations

import copy

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve._lora import MultiLora, lora_delta
from plyx.serve.engine import Engine, EngineConfig
from plyx.specs.errors import ConfigError

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [7, 8, 9, 10, 11], [2, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("n, r, rows, d_in, d_out", [(1, 1, 1, 8, 8), (3, 4, 9, 41, 33), (5, 8, 64, 64, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lora_delta_matches_a_per_row_float64_reference(n, r, rows, d_in, d_out, dtype):
    g = torch.Generator().manual_seed(n * 100 + rows)
    x = torch.randn(rows, d_in, generator=g, dtype=torch.float64)
    A = torch.randn(n, r, d_in, generator=g, dtype=torch.float64)
    B = torch.randn(n, d_out, r, generator=g, dtype=torch.float64)
    index = torch.randint(-1, n, (rows,), generator=g)
    want = torch.stack([B[a] @ (A[a] @ x[i]) if a >= 0 else torch.zeros(d_out, dtype=torch.float64)
                        for i, a in enumerate(index.tolist())])
    got = lora_delta(x.to(dtype), A.to(dtype), B.to(dtype), index)
    tol = 1e-12 if dtype == torch.float64 else 1e-4  # fp32: two matmuls of length <= 64
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def _save_adapter(base, path, *, r, targets, seed):
    from plyx.model.adapters import LoraConfig, add_adapter, save_peft

    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    add_adapter(model, LoraConfig(r=r, alpha=2 * r, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # larger updates than the init: the adapters change the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(8.0)
    save_peft(model, path)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, make_model):
    base = make_model(seed=0, init_std=0.1)
    d = tmp_path_factory.mktemp("adapters")
    paths = {
        "alpha": _save_adapter(base, d / "alpha", r=4, targets=("q_proj", "v_proj"), seed=1),
        "beta": _save_adapter(base, d / "beta", r=8, targets=("o_proj", "gate_proj", "down_proj"), seed=2),
    }
    return base, paths


def _alone(model, prompt, adapter_path=None, device="cpu"):
    """The request run alone on its own model (the adapter merged in): the expected greedy tokens."""
    from plyx.model.adapters import load_peft, merge_and_unload

    m = copy.deepcopy(model)
    if adapter_path is not None:
        load_peft(m, adapter_path)
        m = merge_and_unload(m)
    m = m.to(device)
    engine = Engine(m, config=EngineConfig(max_batch_size=1, block_size=4, num_blocks=64, prefix_caching=False))
    return engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))[0].outputs[0]


@pytest.mark.parametrize("mixed_chunk, device", [
    (0, "cpu"),
    (8, "cpu"),  # 8: prefill chunks ride in the decodes' left-padded forward
    pytest.param(16, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_a_step_mixes_adapters_and_the_base(adapters, mixed_chunk, device):
    base, paths = adapters
    served = copy.deepcopy(base)
    lora = MultiLora.load(served, paths)
    served.to(device)  # the stacked adapters are buffers: they move with the model
    engine = Engine(served, lora=lora, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4,
                                                           num_blocks=128, mixed_chunk=mixed_chunk))
    plan = [("alpha", PROMPTS[0]), (None, PROMPTS[1]), ("beta", PROMPTS[2]), ("alpha", PROMPTS[3]),
            (None, PROMPTS[0]), ("beta", PROMPTS[0])]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    for i, (adapter, prompt) in enumerate(plan):
        engine.add_request(f"r{i}", prompt, params, adapter=adapter)
    got: dict[str, list[int]] = {}
    mixed_steps = 0
    while engine.has_unfinished():
        running = {s.request.adapter for s in engine.running}
        mixed_steps += len(running) > 1
        for out in engine.step():
            if out.event is not None:
                got.setdefault(out.request_id, []).extend(out.event.token_ids)
    assert mixed_steps > 0  # the adapters and the base shared forwards
    outs = {}
    for i, (adapter, prompt) in enumerate(plan):
        want = _alone(base, prompt, paths.get(adapter), device)
        assert got[f"r{i}"] == list(want.token_ids), (adapter, prompt)
        outs[(adapter, tuple(prompt))] = got[f"r{i}"]
    # the adapters really change the output (otherwise the test proves nothing)
    p0 = tuple(PROMPTS[0])
    assert len({tuple(outs[("alpha", p0)]), tuple(outs[(None, p0)]), tuple(outs[("beta", p0)])}) == 3
    with pytest.raises(ConfigError, match="'gamma' is not resident.*alpha, beta"):
        engine.add_request("bad", PROMPTS[0], params, adapter="gamma")


def test_adapters_that_do_not_fit_are_named(adapters, make_model, tmp_path):
    base, paths = adapters
    other = make_model(seed=0, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)  # another base: other widths
    with pytest.raises(ConfigError) as e:
        MultiLora.load(other, {"alpha": paths["alpha"]})
    msg = str(e.value)
    assert "--lora alpha=" in msg and "r=4" in msg and "q_proj" in msg and "vs model" in msg
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        MultiLora.load(copy.deepcopy(base), {"x": tmp_path})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton BGMV path runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_path_matches_the_reference(dtype):
    from plyx.serve._lora import _delta

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g)
    A = torch.randn(3, 8, 64, generator=g) / 8
    B = torch.randn(3, 96, 8, generator=g)
    index = torch.randint(-1, 3, (37,), generator=g)
    want = lora_delta(x.double(), A.double(), B.double(), index)
    got = _delta(x.cuda().to(dtype), A.cuda().to(dtype), B.cuda().to(dtype), index.cuda())
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # relative to the largest magnitude
    assert (got.double().cpu() - want).abs().max() <= tol * want.abs().max()
