"""``plyx serve BASE --lora NAME=PATH``: adapters listed by /v1/models, named per request, concurrent requests of
different adapters and the base each equal to their model run alone, and a startup error for one that does not fit."""

from __future__ import annotations

import argparse
import copy
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from plyx.serve.server import SERVE_COMMAND, build_server, serve_config_from_args
from plyx.specs.errors import ConfigError


def _args(argv):
    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, server_lm):
    from plyx.model.adapters import LoraConfig, add_adapter, save_peft

    out = {}
    for seed, (name, targets) in enumerate([("alpha", ("q_proj", "v_proj")), ("beta", ("up_proj", "o_proj"))]):
        m = copy.deepcopy(server_lm)
        torch.manual_seed(seed)
        add_adapter(m, LoraConfig(r=4, alpha=8, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        out[name] = tmp_path_factory.mktemp("lora") / name
        save_peft(m, out[name])
    return out


def _merged(server_lm, path):
    from plyx.model.adapters import load_peft, merge_and_unload

    m = copy.deepcopy(server_lm)
    load_peft(m, path)
    return merge_and_unload(m)


def test_adapters_are_models_of_the_server(model_dir, adapter_dirs, server_lm, bpe, serving, greedy_reference):
    from plyx.serve.server._cli import lora_specs

    args = _args([str(model_dir), "--lora", f"alpha={adapter_dirs['alpha']}", "--lora",
                  f"beta={adapter_dirs['beta']}", "--max-batch-size", "8", "--block-size", "4"])
    app = build_server(serve_config_from_args(args), chat_template="chatml", lora=lora_specs(args.lora))
    with serving.serve(app) as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "alpha", "beta"}
        assert models["alpha"].parent == "tiny" and models["beta"].root == "beta"
        # no path of the server's file system in the listing; each listed id can be retrieved on its own
        listing = client.models.list().model_dump_json()
        assert str(adapter_dirs["beta"]) not in listing and str(model_dir) not in listing
        assert client.models.retrieve("alpha").parent == "tiny" and client.models.retrieve("tiny").id == "tiny"
        prompts = ["hello world, the quick", "the quick brown fox", "You are a helpful"]
        jobs = [(m, p) for p in prompts for m in ("tiny", "alpha", "beta")]

        def ask(job):
            r = client.completions.create(model=job[0], prompt=job[1], max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == job[0]
            return r.choices[0].text

        with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the engine batches the adapters together
            texts = list(pool.map(ask, jobs))
        models_by_name = {"tiny": server_lm, **{n: _merged(server_lm, p) for n, p in adapter_dirs.items()}}
        for (name, prompt), text in zip(jobs, texts):
            want = greedy_reference(models_by_name[name], bpe, bpe.encode(prompt).ids, 12, ignore_eos=True)
            assert text == want.text, (name, prompt)
        assert len({t for (n, p), t in zip(jobs, texts) if p == prompts[0]}) == 3  # the adapters matter
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gamma", prompt="hi", max_tokens=2)

        # adapters load and unload at run time (between engine steps)
        import httpx

        post = httpx.Client(base_url=running.base_url, timeout=60).post
        r = post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapter_dirs["beta"])})
        assert r.status_code == 200, r.text
        assert "gamma" in {m.id for m in client.models.list().data}
        assert ask(("gamma", prompts[0])) == texts[jobs.index(("beta", prompts[0]))]
        bad = post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(model_dir)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        taken = post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapter_dirs["beta"])})
        assert taken.status_code == 400 and "resident already" in taken.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200
        assert ask(("beta", prompts[1])) == texts[jobs.index(("beta", prompts[1]))]  # indices shifted, same output
        assert ask(("gamma", prompts[1])) == texts[jobs.index(("beta", prompts[1]))]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alpha", prompt="hi", max_tokens=2)
        assert post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 404


def test_an_adapter_of_another_base_is_a_startup_error(model_dir, tmp_path, make_model):
    from plyx.model.adapters import LoraConfig, add_adapter, save_peft
    from plyx.serve.server._cli import lora_specs

    other = make_model(d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    add_adapter(other, LoraConfig(r=2, target_modules=("q_proj",)))
    save_peft(other, tmp_path / "other")
    args = _args([str(model_dir), "--lora", f"odd={tmp_path / 'other'}"])
    with pytest.raises(ConfigError) as e:
        build_server(serve_config_from_args(args), lora=lora_specs(args.lora))
    assert "--lora odd=" in str(e.value) and "r=2" in str(e.value) and "vs model" in str(e.value)
    with pytest.raises(ConfigError, match="NAME=PATH"):
        lora_specs(["just-a-path"])
