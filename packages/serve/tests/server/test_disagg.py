"""Disaggregated prefill/decode: KV blocks handed over give the colocated engine's tokens; the two-process
server (front end + decode engine, prefill worker process, gloo send/recv) answers through the real OpenAI
front end; a dead worker is a 503 that names it, with no hang."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.serve.engine._kv_transfer import KVBlocks, export_prefix, import_prefix

from .conftest import API_KEY, MODEL_NAME, serve, small_lm

PROMPT = ("You are a helpful assistant. Answer briefly. hello world, the quick brown fox 0123456789 "
          '{"answer": "yes", "count": 3, "ok": true}')


HUNG_AFTER = 8.0  # the front end's receive timeout: a prefill of the tiny model takes milliseconds


def _engine(model, **kw):
    return Engine(model, config=EngineConfig(**{"max_batch_size": 8, "max_batch_tokens": 64, "block_size": 8,
                                                "num_blocks": 96, **kw}))


def test_handed_over_kv_gives_the_colocated_greedy_tokens():
    model = small_lm(vocab=128, max_seq_len=256)
    g = torch.Generator().manual_seed(3)
    # lengths around block edges: none, one block + 1, exact blocks, a long chunked one
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 32, 33, 150)]
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    colocated = _engine(model).generate(prompts, greedy)

    prefill, decode = _engine(model), _engine(model)
    imported = 0
    for p in prompts:
        prefill.generate([p], SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
        blocks = export_prefix(prefill, p)
        assert blocks.num_tokens == (len(p) - 1) // 8 * 8  # whole blocks, never the last token
        assert blocks.k.shape == (2, blocks.num_tokens // 8, 8, 2, 16)
        imported += import_prefix(decode, p, blocks)
    out = decode.generate(prompts, greedy)
    for a, b in zip(colocated, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # the decode engine computed only the tails: the handed-over blocks were used, not recomputed
    assert decode.stats.prompt_tokens == sum(len(p) for p in prompts) - imported
    assert imported == sum((len(p) - 1) // 8 * 8 for p in prompts)

    # wrong keys and values would change the answer: the import is what the decode reads
    p = prompts[-1]
    bad = export_prefix(prefill, p)
    other = _engine(model)
    import_prefix(other, p, KVBlocks(bad.num_tokens, torch.randn_like(bad.k), torch.randn_like(bad.v)))
    assert other.generate([p], greedy)[0].outputs[0].token_ids != colocated[-1].outputs[0].token_ids


def test_import_without_room_falls_back_to_recompute():
    model = small_lm(vocab=128, max_seq_len=64)
    p = list(range(3, 60))
    prefill = _engine(model)
    prefill.generate([p], SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
    blocks = export_prefix(prefill, p)
    tight = _engine(model, num_blocks=9, max_batch_size=1, prefix_caching=True)
    tight.cache.allocate(7)
    tight.cache.reserve([7], [64])  # 8 of the 9 blocks are taken: no room for 7 imported blocks
    assert import_prefix(tight, p, blocks) == 0
    tight.cache.evict(7)
    greedy = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    assert tight.generate([p], greedy)[0].outputs[0].token_ids == _engine(model).generate([p], greedy)[0].outputs[0].token_ids


def test_disaggregate_refuses_what_it_cannot_hand_over():
    from plyx.serve.engine._kv_transfer import check_transferable
    from plyx.specs.errors import ConfigError

    model = small_lm(vocab=128, max_seq_len=64)
    with pytest.raises(ConfigError, match="prefix cache"):
        check_transferable(_engine(model, prefix_caching=False))
    with pytest.raises(ConfigError, match="quantised cache"):
        check_transferable(_engine(model, kv_cache_dtype="int8"))


def _pair(consumer_device, producer_device, handler, geometry=(2, 4, 2, 8), producer_geometry=None, timeout=30.0):
    """Both ends of a torch_distributed connector in one process (the producer on a thread)."""
    import threading

    from plyx.serve.disagg import get_kv_connector

    factory = get_kv_connector("torch_distributed")
    consumer = factory(role="consumer", address="127.0.0.1:0", timeout=timeout, device=consumer_device)
    producer_box = {}

    def produce():
        producer = factory(role="producer", address=consumer.address, device=producer_device)
        producer_box["p"] = producer
        producer.connect(producer_geometry or geometry, torch.float32)
        producer.serve(handler)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    return consumer, t


@pytest.mark.parametrize("devices", [
    ("cpu", "cpu"),
    pytest.param(("cuda:0", "cuda:0"), marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
    pytest.param(("cuda:0", "cuda:1"), marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")),
], ids=["cpu-gloo", "one-gpu-gloo", "two-gpus-nccl"])
def test_connector_hands_blocks_over(devices):
    consumer_device, producer_device = devices

    def handler(prompt):  # blocks whose values encode the prompt: the consumer checks them exactly
        nb = (len(prompt) - 1) // 4
        k = torch.arange(2 * nb * 4 * 2 * 8, dtype=torch.float32, device=producer_device).reshape(2, nb, 4, 2, 8)
        if prompt[0] == 99:
            raise ValueError("prompt starts with 99")
        return KVBlocks(nb * 4, k + prompt[0], -k)

    consumer, t = _pair(consumer_device, producer_device, handler)
    consumer.connect((2, 4, 2, 8), torch.float32)
    blocks = consumer.prefill([5] * 11)
    assert blocks.num_tokens == 8 and blocks.k.shape == (2, 2, 4, 2, 8)
    ref = torch.arange(2 * 2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 2, 4, 2, 8)
    assert torch.equal(blocks.k.cpu(), ref + 5) and torch.equal(blocks.v.cpu(), -ref)
    assert consumer.prefill([7, 1]).num_tokens == 0  # shorter than a block + 1: nothing to hand over
    from plyx.serve.disagg import KVRequestError

    with pytest.raises(KVRequestError, match="prompt starts with 99"):  # the worker's error, and it goes on
        consumer.prefill([99] * 9)
    assert consumer.prefill([6] * 5).num_tokens == 4
    consumer.close()
    t.join(10)
    assert not t.is_alive()


def test_connector_refuses_another_cache_geometry():
    from plyx.serve.disagg import KVTransferError

    consumer, t = _pair("cpu", "cpu", lambda p: None, producer_geometry=(2, 8, 2, 8))
    with pytest.raises(KVTransferError, match=r"block_size.*\(1, 2, 8, 2, 8, 0\).*\(1, 2, 4, 2, 8, 0\)"):
        consumer.connect((2, 4, 2, 8), torch.float32)
    consumer.close()
    t.join(10)
    assert not t.is_alive()


def test_kv_connector_plugin_lookup():
    from plyx.serve.disagg import TorchDistributedConnector, get_kv_connector
    from plyx.specs.errors import ConfigError

    assert get_kv_connector("torch_distributed") is TorchDistributedConnector
    with pytest.raises(ConfigError, match="'nixl' not found.*torch_distributed"):
        get_kv_connector("nixl")


def test_cli_options_of_disaggregation():
    import argparse

    from plyx.serve.server import SERVE_COMMAND
    from plyx.serve.server._cli import _disagg_options

    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    assert _disagg_options(p.parse_args(["/m"])) is None
    args = p.parse_args(["/m", "--disaggregate", "--prefill-device", "cuda:1", "--kv-timeout", "5"])
    assert _disagg_options(args) == {"device": "cuda:1", "connector": "torch_distributed", "backend": "auto",
                                     "timeout": 5.0}


def test_a_worker_that_cannot_start_is_an_error_quoting_its_log(tmp_path):
    from plyx.serve.disagg import WorkerUnavailableError, start_prefill_worker

    engine = _engine(small_lm(vocab=128, max_seq_len=64))
    missing = tmp_path / "no-such-checkpoint"
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailableError, match=r"(?s)prefill worker \(pid \d+\) exited with code 1 before "
                       r"joining.*no-such-checkpoint"):
        start_prefill_worker(missing, engine, threads=1, env={"OMP_NUM_THREADS": "1"})
    assert time.monotonic() - t0 < 120


@pytest.fixture(scope="module")
def disagg_server(model_dir):
    from plyx.serve.server import build_server
    from plyx.specs.config.serve import ServeConfig

    cfg = ServeConfig(model=str(model_dir), served_name=MODEL_NAME, api_key=API_KEY, device="cpu", block_size=4,
                      num_blocks=256, max_batch_size=8, max_batch_tokens=64)
    app = build_server(cfg, chat_template="chatml", drain_timeout=5,
                       disaggregate={"threads": 1, "timeout": HUNG_AFTER, "env": {"OMP_NUM_THREADS": "1"}})
    with serve(app) as running:
        yield running


def test_two_processes_answer_through_the_openai_front_end(disagg_server, bpe, server_lm, greedy_reference):
    import openai

    client = openai.OpenAI(base_url=disagg_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    ids = bpe.encode(PROMPT).ids
    assert out.choices[0].text == bpe.decode(greedy_reference(server_lm, bpe, ids, 8).token_ids)
    aengine = disagg_server.app.state.plyx.aengine
    assert aengine.worker.proc.poll() is None and aengine.worker.proc.pid != os.getpid()
    assert aengine.remote_prefills == 1
    assert aengine.imported_tokens == (len(ids) - 1) // 4 * 4  # the worker's blocks, not a local prefill
    assert disagg_server.engine.stats.prompt_tokens == len(ids) - aengine.imported_tokens
    assert httpx.get(disagg_server.base_url + "/health").status_code == 200


def test_a_hung_prefill_worker_is_a_503_after_the_timeout(disagg_server):
    aengine = disagg_server.app.state.plyx.aengine
    pid = aengine.worker.proc.pid
    os.kill(pid, signal.SIGSTOP)  # alive, but it never answers
    t0 = time.monotonic()
    r = httpx.post(disagg_server.base_url + "/v1/completions", headers=disagg_server.headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PROMPT + " again", "max_tokens": 4})
    waited = time.monotonic() - t0
    assert r.status_code == 503 and HUNG_AFTER - 1 < waited < HUNG_AFTER + 20
    assert f"prefill worker (pid {pid}) did not answer within 8 s" in r.json()["error"]["message"]
    os.kill(pid, signal.SIGKILL)  # the next test sees it dead


def test_a_dead_prefill_worker_is_a_503_naming_it(disagg_server):
    aengine = disagg_server.app.state.plyx.aengine
    pid = aengine.worker.proc.pid
    if aengine.worker.proc.poll() is None:
        os.kill(pid, signal.SIGKILL)
    aengine.worker.proc.wait(10)
    t0 = time.monotonic()
    r = httpx.post(disagg_server.base_url + "/v1/completions", headers=disagg_server.headers, timeout=30,
                   json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4})
    assert time.monotonic() - t0 < 10  # answered at once, no wait on the dead peer
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "worker_unavailable"
    assert f"prefill worker (pid {pid}) exited with code -9" in err["message"]
    h = httpx.get(disagg_server.base_url + "/health")
    assert h.status_code == 503 and f"pid {pid}" in h.json()["error"]["message"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_processes_on_gpus(model_dir, bpe):
    """On a GPU: the worker on the second GPU when there are two (NCCL), else sharing the first (gloo)."""
    import openai
    from plyx.model import load_checkpoint
    from plyx.serve.server import build_server
    from plyx.specs.config.serve import ServeConfig

    cfg = ServeConfig(model=str(model_dir), served_name=MODEL_NAME, api_key=API_KEY, device="cuda", block_size=4,
                      num_blocks=256, max_batch_size=8, max_batch_tokens=64)
    app = build_server(cfg, chat_template="chatml", drain_timeout=5, disaggregate={"timeout": 60})
    ids = bpe.encode(PROMPT).ids
    colocated = Engine(load_checkpoint(model_dir, device="cuda"), config=EngineConfig(
        max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=256))
    want = colocated.generate([ids], SamplingParams(temperature=0, max_new_tokens=8))[0].outputs[0].token_ids
    with serve(app) as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key=API_KEY, max_retries=0)
        out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
        aengine = running.app.state.plyx.aengine
        assert out.choices[0].text == bpe.decode(list(want))
        assert aengine.remote_prefills == 1 and aengine.imported_tokens == (len(ids) - 1) // 4 * 4
        want_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        assert aengine.worker.argv[aengine.worker.argv.index("--device") + 1] == want_device
