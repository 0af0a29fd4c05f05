"""``QuantizedPagedKVCache`` (int8 / fp8_e4m3 storage): memory, the attention paths that read and write it,
and the errors of an unsupported dtype. The conformance kit runs on it in ``test_conformance.py``."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import (
    Attention,
    PagedKVCache,
    QuantizedPagedKVCache,
    StaticDecode,
    begin_packed_step,
    begin_step,
    check_kv_cache_dtype,
)
from plyx.kernel import rope_tables
from plyx.specs.kvcache import CacheLayout
from plyx.specs.testing.kvcache import check_kvcache, default_layout

D, DH, H, KV = 32, 8, 4, 2
KINDS = ["int8", "fp8_e4m3"]


def _layout(dtype: str = "float64", **kw) -> CacheLayout:
    base = dict(num_layers=1, num_kv_heads=KV, head_dim=DH, dtype=dtype, device="cpu", max_seq_len=64,
                block_size=4, num_blocks=40)
    return CacheLayout(**{**base, **kw})


class FakeQuant(PagedKVCache):
    """The oracle: a float cache storing what the quantised one would give back (``storage_roundtrip``)."""

    def __init__(self, layout: CacheLayout, twin: QuantizedPagedKVCache) -> None:
        super().__init__(layout)
        self.twin = twin

    def append(self, layer, seq_ids, k, v):
        super().append(layer, seq_ids, self.twin.storage_roundtrip(k), self.twin.storage_roundtrip(v))


def _attention() -> Attention:
    torch.manual_seed(0)
    attn = Attention(d_model=D, n_heads=H, n_kv_heads=KV, head_dim=DH, dtype=torch.float64)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn


def _step(attn, cache, chunks, seq_ids=(0, 1)):
    """One left-padded step of ``chunks`` (one [n, D] tensor per row) through ``begin_step``."""
    T = max(c.shape[0] for c in chunks)
    x = torch.zeros(len(chunks), T, D, dtype=torch.float64)
    mask = torch.zeros(len(chunks), T, dtype=torch.bool)
    for r, c in enumerate(chunks):
        x[r, T - c.shape[0]:] = c
        mask[r, T - c.shape[0]:] = True
    st = begin_step(cache, list(seq_ids), len(chunks), T, mask if not mask.all() else None, x.device)
    positions = st.lengths_before[:, None] + (mask.long().cumsum(1) - 1).clamp(min=0)
    cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
    y = attn(x, cos, sin, step=st)
    return [y[r, T - c.shape[0]:] for r, c in enumerate(chunks)]


@pytest.mark.parametrize("kv_dtype", KINDS)
def test_attention_reads_and_writes_the_quantised_cache(kv_dtype):
    """Prefill (> 16 tokens: the gathered path through ``read``), a chunk and decode steps (``paged_attention_quant``)
    give what attention over the dequantised values gives: the quantised cache adds no error of its own."""
    attn = _attention()
    cache = QuantizedPagedKVCache(_layout(), kv_dtype=kv_dtype)
    oracle = FakeQuant(_layout(), cache)
    xs = [torch.randn(30, D, dtype=torch.float64) for _ in range(2)]
    plan = [(slice(0, 17), slice(0, 20)), (slice(17, 20), slice(20, 21)), (slice(20, 21), slice(21, 22)),
            (slice(21, 22), slice(22, 23))]
    for a, b in plan:
        got = _step(attn, cache, [xs[0][a], xs[1][b]])
        want = _step(attn, oracle, [xs[0][a], xs[1][b]])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # float32 vs float64 dequantisation
    # and the quantisation error itself is small but not zero
    exact = PagedKVCache(_layout())
    for a, b in plan:
        ref = _step(attn, exact, [xs[0][a], xs[1][b]])
    err = (got[0] - ref[0]).detach().abs().max() / ref[0].detach().abs().max()
    assert 0 < float(err) < (0.02 if kv_dtype == "int8" else 0.1)


@pytest.mark.parametrize("fused", [True, False], ids=["rope_store_kv_quant", "write_slots"])
@pytest.mark.parametrize("kv_dtype", KINDS)
def test_static_decode_step_writes_through_the_quantising_store(kv_dtype, fused):
    """A static (graph-capturable) step quantises its keys and values (``rope_store_kv_quant``, or the cache's
    ``write_slots``) and attends like an eager step (``append``: ``store_kv_quant``), writing the same bytes."""
    attn = _attention()
    caches = [QuantizedPagedKVCache(_layout(), kv_dtype=kv_dtype) for _ in range(2)]
    xs = [torch.randn(12, D, dtype=torch.float64) for _ in range(2)]
    for cache in caches:
        _step(attn, cache, [xs[0][:9], xs[1][:5]])
    eager = _step(attn, caches[0], [xs[0][9:10], xs[1][5:6]])
    static = StaticDecode(caches[1], max_batch=2)
    static.prepare([0, 1], [0, 0], 2)  # tokens are not used here: the layer takes x directly
    _, positions, st = static.inputs(2)
    x = torch.stack([xs[0][9:10], xs[1][5:6]])  # (2, 1, D)
    cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
    attn.pack_projections_()
    # packed projections are read at inference only (then rope_store_kv_quant writes, one launch); with a
    # gradient the step projects unpacked and stores through the cache's write_slots
    with torch.set_grad_enabled(not fused):
        y = attn(x, cos, sin, step=st)
    for row in range(2):
        torch.testing.assert_close(y[row], eager[row], rtol=1e-10, atol=1e-10)
        for a, b in zip(caches[0].read(0, row), caches[1].read(0, row)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False], ids=["rope_store_kv_quant", "write_slots"])
@pytest.mark.parametrize("kv_dtype", KINDS)
def test_packed_step_attends_over_the_quantised_pools(kv_dtype, fused, monkeypatch):
    """A packed step (decodes and a prefill chunk in one ``[1, N]`` row, ``begin_packed_step``) quantises its
    keys and values into the pools and attends through ``paged_attention_quant`` group by group, giving what
    per-group eager steps give, with the same bytes stored; it never dequantises a sequence whole (``read``)."""
    attn = _attention()
    caches = [QuantizedPagedKVCache(_layout(), kv_dtype=kv_dtype) for _ in range(2)]
    xs = [torch.randn(30, D, dtype=torch.float64) for _ in range(3)]
    for cache in caches:  # rows 0 and 1 hold a prompt; row 2 arrives with the packed step
        _step(attn, cache, [xs[0][:9], xs[1][:5]])
    eager = _step(attn, caches[0], [xs[0][9:10], xs[1][5:6]])  # two decodes
    eager += _step(attn, caches[0], [xs[2][:20]], seq_ids=(2,))  # a 20-token prompt chunk (> PAGED_MAX_QUERY)

    def no_read(*a, **k):
        raise AssertionError("a packed step dequantised a whole sequence (read)")

    monkeypatch.setattr(caches[1], "read", no_read)
    _, positions, st = begin_packed_step(caches[1], [0, 1, 2], [1, 1, 20], [0] * 22, torch.device("cpu"))
    x = torch.cat([xs[0][9:10], xs[1][5:6], xs[2][:20]])[None]  # (1, 22, D)
    cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
    attn.pack_projections_()
    with torch.set_grad_enabled(not fused):  # fused: rope_store_kv_quant; with a gradient: write_slots
        y = attn(x, cos, sin, step=st)[0]  # (22, D)
    for got, want, tol in zip((y[0:1], y[1:2], y[2:]), eager, (1e-10, 1e-10, 1e-6)):
        # the eager chunk's gathered path dequantises in float32 (``read``), the paged kernel in float64
        torch.testing.assert_close(got, want, rtol=10 * tol, atol=tol)
    monkeypatch.undo()
    for row in range(3):
        for a, b in zip(caches[0].read(0, row), caches[1].read(0, row)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kv_dtype", KINDS)
def test_memory_per_token_is_halved(kv_dtype):
    """From the allocation itself: every tensor the cache holds, against the bfloat16 paged cache."""
    layout = _layout("bfloat16", num_layers=2, num_kv_heads=8, head_dim=128, num_blocks=6, block_size=16)
    quant, plain = QuantizedPagedKVCache(layout, kv_dtype=kv_dtype), PagedKVCache(layout)
    held = sum(t.numel() * t.element_size() for t in (*quant._k, *quant._v, *quant._ks, *quant._vs))
    held_plain = sum(t.numel() * t.element_size() for t in (*plain._k, *plain._v))
    assert quant.usage().bytes_total == held and plain.usage().bytes_total == held_plain
    per_token = held / (6 * 16)
    assert per_token == 2 * 2 * 8 * (128 + 4)  # layers x (k, v) x heads x (Dh bytes + a float32 scale)
    assert per_token / (held_plain / (6 * 16)) == pytest.approx(132 / 256)
    assert per_token <= 0.52 * held_plain / (6 * 16)


def test_unsupported_kv_dtype_names_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="unknown quantised KV-cache dtype 'int4'.*int8, fp8_e4m3"):
        check_kv_cache_dtype("int4", "cpu")
    with pytest.raises(ValueError, match="CPU and on Hopper.*not on meta.*'int8'"):
        QuantizedPagedKVCache(_layout(device="meta"), kv_dtype="fp8_e4m3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 9.0.*A100.*sm_80.*kv_cache_dtype='int8'"):
        check_kv_cache_dtype("fp8_e4m3", "cuda:0")
    assert check_kv_cache_dtype("int8", "cuda:0") == torch.int8  # int8 runs on any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert check_kv_cache_dtype("fp8_e4m3", "cuda:0") == torch.float8_e4m3fn


def test_the_kit_catches_a_quantised_cache_that_hides_its_loss():
    class Lying(QuantizedPagedKVCache):
        def storage_roundtrip(self, x):  # claims lossless storage
            return x

    with pytest.raises(AssertionError):
        check_kvcache(lambda layout: Lying(layout, kv_dtype="int8"), default_layout())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton store and paged kernels)")
@pytest.mark.parametrize("kv_dtype", KINDS)
def test_cuda_bf16_attention_over_the_quantised_cache(kv_dtype):
    """On a GPU in bfloat16 (head_dim 64: the Triton kernels), eager and static steps against the oracle."""
    if kv_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (9, 0):
        with pytest.raises(ValueError, match="int8"):
            QuantizedPagedKVCache(_layout("bfloat16", device="cuda"), kv_dtype=kv_dtype)
        return
    dh, d = 64, 256
    torch.manual_seed(0)
    attn = Attention(d_model=d, n_heads=4, n_kv_heads=2, head_dim=dh, device="cuda", dtype=torch.bfloat16)
    layout = _layout("bfloat16", device="cuda", head_dim=dh, block_size=16, num_blocks=16, max_seq_len=128)
    cache = QuantizedPagedKVCache(layout, kv_dtype=kv_dtype)
    oracle = FakeQuant(layout, cache)
    xs = torch.randn(2, 40, d, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for chunk in (slice(0, 20), slice(20, 23), slice(23, 24), slice(24, 25)):
            outs = []
            for c in (cache, oracle):
                x = xs[:, chunk]
                st = begin_step(c, [0, 1], 2, x.shape[1], None, x.device)
                positions = st.lengths_before[:, None] + torch.arange(x.shape[1], device="cuda")
                cos, sin = rope_tables(positions, dh, 10000.0, dtype=torch.bfloat16)
                outs.append(attn(x, cos, sin, step=st).float())
            err = (outs[0] - outs[1]).norm() / outs[1].norm()
            assert float(err) < 2e-2, (kv_dtype, chunk, float(err))  # bf16 roundings of P and the output
