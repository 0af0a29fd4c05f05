"""``plyx serve CKPT --draft-heads PATH --spec-tree K``: greedy completions equal the model's greedy answers, the
speculation counters show on /metrics, and heads that do not fit are a startup error."""

from __future__ import annotations

import argparse
import re

import httpx
import openai
import pytest
import torch
from plyx.model import build_draft_heads, save_draft_heads
from plyx.serve.server import SERVE_COMMAND, build_server, serve_config_from_args
from plyx.specs.errors import ConfigError


def _args(argv):
    p = argparse.ArgumentParser()
    SERVE_COMMAND.configure(p)
    return p.parse_args(argv)


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_serve_with_draft_heads(model_dir, server_lm, bpe, serving, greedy_reference, tmp_path):
    # heads initialised from the base (head k's LM head is the base's): untrained, they draft something plausible
    torch.manual_seed(0)
    heads = save_draft_heads(build_draft_heads("medusa", server_lm.config, num_heads=3).init_from_base(server_lm),
                             tmp_path / "heads")
    args = _args([str(model_dir), "--draft-heads", str(heads), "--spec-tree", "2", "--speculative-k", "2",
                  "--max-batch-size", "8", "--block-size", "4"])
    app = build_server(serve_config_from_args(args), chat_template="chatml", draft_heads=args.draft_heads,
                       speculative_k=args.speculative_k, spec_tree=args.spec_tree)
    with serving.serve(app) as running:
        assert running.engine.proposer is not None and running.engine.spec_k == 2
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in ("hello world, the quick", "You are a helpful"):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            want = greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 16, ignore_eos=True)
            assert r.choices[0].text == want.text
        text = httpx.get(running.base_url + "/metrics").text
        drafted = _metric(text, "plyx_spec_decode_num_draft_tokens_total")
        rows = _metric(text, "plyx_spec_decode_num_verified_rows_total")
        assert drafted >= rows > 0
        assert 0 <= _metric(text, "plyx_spec_decode_num_accepted_tokens_total") <= 2 * rows


def test_heads_of_another_model_fail_at_startup(model_dir, server_lm, tmp_path):
    other = build_draft_heads("medusa", server_lm.config.replace(d_model=48, n_heads=4), num_heads=2)
    path = save_draft_heads(other, tmp_path / "other")
    args = _args([str(model_dir), "--draft-heads", str(path)])
    with pytest.raises(ConfigError, match="d_model: 48 for the heads.*at `EngineConfig.draft_heads`"):
        build_server(serve_config_from_args(args), draft_heads=args.draft_heads)
