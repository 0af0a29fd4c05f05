"""Layer-streaming forward: lossless against the bulk forward, one layer resident at a time."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import make_cache
from plyx.model import LayerStreamer, save_checkpoint, save_hf, stream_forward


@pytest.mark.parametrize("source", ["plyx-checkpoint", "hf-directory", "cpu-model"])
def test_streaming_equals_bulk(tmp_path, tiny, random_model, source: str) -> None:
    model = random_model(tiny(arch="qwen3", qk_norm=True, head_dim=16, n_layers=4))
    if source == "plyx-checkpoint":
        src = save_checkpoint(model, tmp_path / "c", max_shard_bytes=30_000)
    elif source == "hf-directory":
        src = save_hf(model, tmp_path / "h")
    else:
        src = model
    streamer = LayerStreamer(src)
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(streamer(ids), model(ids), rtol=1e-6, atol=1e-6)
        hidden = streamer(ids, return_hidden=True)
        torch.testing.assert_close(hidden, model(ids, return_hidden=True), rtol=1e-6, atol=1e-6)
    assert streamer.max_resident_layers == 1, "more than one decoder layer was materialised at once"
    assert all(p.is_meta for p in streamer.skeleton.layers.parameters()), "the skeleton must hold no layer weights"


def test_streaming_with_cache_and_dtype(tmp_path, tiny, random_model) -> None:
    model = random_model(tiny(n_layers=3))
    path = save_checkpoint(model, tmp_path / "c")
    streamer = LayerStreamer(path, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, 8))
    cache = make_cache("paged", streamer.config, block_size=4, dtype=torch.float64)
    out = torch.cat([streamer(ids[:, :5], cache=cache)] + [streamer(ids[:, t:t + 1], cache=cache) for t in (5, 6, 7)], 1)
    torch.testing.assert_close(out, model.double()(ids), rtol=1e-6, atol=1e-6)
    assert cache.length(0) == 8


def test_stream_forward_function(tmp_path, tiny, random_model) -> None:
    model = random_model(tiny())
    ids = torch.randint(0, 97, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(stream_forward(model, ids), model(ids))
    with pytest.raises(TypeError, match="unexpected arguments"):
        stream_forward(model, ids, bogus=1)
