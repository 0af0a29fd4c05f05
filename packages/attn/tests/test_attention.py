"""The Attention module against a float64 attention written out by hand (MHA/GQA/MQA, QK-norm, masks, RoPE),
and its cached path (both cache kinds, left padding) against the uncached one."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import Attention, begin_step, make_cache
from plyx.kernel import rope_tables
from plyx.specs import ModelConfig

D, DH = 32, 8


def naive(attn: Attention, x, positions, *, allowed) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) masked) v, every step spelled out in float64. allowed: bool [B, T, S]."""
    B, T, _ = x.shape
    H, KV = attn.n_heads, attn.n_kv_heads
    q = (x @ attn.q_proj.weight.T + (attn.q_proj.bias if attn.q_proj.bias is not None else 0)).view(B, T, H, DH)
    k = (x @ attn.k_proj.weight.T + (attn.k_proj.bias if attn.k_proj.bias is not None else 0)).view(B, T, KV, DH)
    v = (x @ attn.v_proj.weight.T + (attn.v_proj.bias if attn.v_proj.bias is not None else 0)).view(B, T, KV, DH)
    if attn.q_norm is not None:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + attn.norm_eps) * attn.q_norm.weight
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + attn.norm_eps) * attn.k_norm.weight
    # the module's inputs: tables [B, T, Dh/2] (angles in float32, as transformers computes them)
    half_cos, half_sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
    cos, sin = torch.cat([half_cos] * 2, -1)[:, :, None], torch.cat([half_sin] * 2, -1)[:, :, None]

    def rot(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / DH**0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, H * DH)
    return out @ attn.o_proj.weight.T


def make(heads: int, kv: int, **kw) -> Attention:
    attn = Attention(d_model=D, n_heads=heads, n_kv_heads=kv, head_dim=DH, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn


@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("variant", ["plain", "qk_norm+bias", "window", "documents", "padding"])
def test_attention_matches_float64_by_hand(heads: int, kv: int, variant: str) -> None:
    B, T = 2, 9
    attn = make(heads, kv, qk_norm=variant == "qk_norm+bias", qkv_bias=variant == "qk_norm+bias",
                sliding_window=3 if variant == "window" else None)
    x = torch.randn(B, T, D, dtype=torch.float64)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i).expand(B, T, T).clone()
    positions = torch.arange(T).expand(B, T)
    kwargs = {}
    if variant == "window":
        allowed &= (i - j) < 3
    if variant == "documents":
        docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 3]])
        allowed &= docs[:, :, None] == docs[:, None, :]
        kwargs["document_ids"] = docs
    if variant == "padding":
        real = torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9]).bool()
        allowed &= real[:, None, :]
        kwargs["key_mask"] = real[:, None, None, :]
    cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
    got = attn(x, cos, sin, **kwargs)
    want = naive(attn, x, positions, allowed=allowed)
    rows = allowed.any(-1)  # queries with nothing to attend to are undefined
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("window", [None, 4])
def test_cached_steps_equal_one_pass(kind: str, window: int | None) -> None:
    """Prefill with left padding, then uneven chunks and single tokens: same outputs as one full pass per row."""
    attn = make(4, 2, sliding_window=window)
    config = ModelConfig(vocab_size=8, d_model=D, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8, max_seq_len=32,
                         dtype="float32")
    cache = make_cache(kind, config, batch_size=2, block_size=3, dtype=torch.float64)
    lens = [5, 11]  # row 0 is shorter: left-padded in the prefill
    xs = [torch.randn(n, D, dtype=torch.float64) for n in lens]

    def full(row: int) -> torch.Tensor:
        n = lens[row]
        cos, sin = rope_tables(torch.arange(n), DH, 10000.0, dtype=torch.float64)
        return attn(xs[row][None], cos, sin)[0]

    outs: list[list[torch.Tensor]] = [[], []]

    def step(chunks: list[torch.Tensor]) -> None:
        T = max(c.shape[0] for c in chunks)
        x = torch.zeros(2, T, D, dtype=torch.float64)
        mask = torch.zeros(2, T, dtype=torch.bool)
        for r, c in enumerate(chunks):
            x[r, T - c.shape[0]:] = c
            mask[r, T - c.shape[0]:] = True
        st = begin_step(cache, [0, 1], 2, T, mask if not mask.all() else None, x.device)
        positions = st.lengths_before[:, None] + (mask.long().cumsum(1) - 1).clamp(min=0)
        cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
        y = attn(x, cos, sin, step=st)
        for r, c in enumerate(chunks):
            outs[r].append(y[r, T - c.shape[0]:])

    step([xs[0][:2], xs[1][:6]])  # prefill, row 0 padded by 4
    step([xs[0][2:3], xs[1][6:9]])  # a chunk and a token
    for t in range(3, 5):
        step([xs[0][t:t + 1], xs[1][t + 6:t + 7]])  # decode
    for row in range(2):
        torch.testing.assert_close(torch.cat(outs[row]), full(row), rtol=1e-10, atol=1e-10)
    assert [cache.length(s) for s in (0, 1)] == lens


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("window", [None, 4])
def test_packed_steps_equal_one_pass(kind: str, window: int | None) -> None:
    """Packed (varlen) steps: each step's tokens of three sequences in one [1, N] row (prefill chunks of different
    lengths next to decode rows, attended per group over the paged cache); same outputs as one full pass per row."""
    from plyx.attn import begin_packed_step

    attn = make(4, 2, sliding_window=window)
    config = ModelConfig(vocab_size=8, d_model=D, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8, max_seq_len=32,
                         dtype="float32")
    cache = make_cache(kind, config, batch_size=3, block_size=3, dtype=torch.float64)
    lens = [6, 13, 9]
    xs = [torch.randn(n, D, dtype=torch.float64) for n in lens]
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    # per step: new tokens of each sequence (0: not scheduled); rows go in the order given
    plan = [[2, 5, 0], [1, 4, 1], [1, 1, 5], [1, 3, 3], [1, 0, 0]]
    for counts in plan:
        rows = [(s, n) for s, n in enumerate(counts) if n]
        rows.sort(key=lambda r: r[1])  # decodes first, equal counts adjacent
        x = torch.cat([xs[s][done[s]:done[s] + n] for s, n in rows])[None]  # (1, N, D)
        _, positions, st = begin_packed_step(cache, [s for s, _ in rows], [n for _, n in rows],
                                             [0] * x.shape[1], x.device)
        assert st.varlen is not None and len(st.varlen) == len({n for _, n in rows})
        cos, sin = rope_tables(positions, DH, 10000.0, dtype=torch.float64)
        y = attn(x, cos, sin, step=st)[0]
        start = 0
        for s, n in rows:
            outs[s].append(y[start:start + n])
            done[s] += n
            start += n
    for s, n in enumerate(lens):
        cos, sin = rope_tables(torch.arange(n), DH, 10000.0, dtype=torch.float64)
        torch.testing.assert_close(torch.cat(outs[s]), attn(xs[s][None], cos, sin)[0], rtol=1e-10, atol=1e-10)
    assert [cache.length(s) for s in range(3)] == lens


def test_packed_step_rejects_bad_rows_and_leaves_the_cache() -> None:
    from plyx.attn import begin_packed_step

    config = ModelConfig(vocab_size=8, d_model=D, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=8, max_seq_len=32,
                         dtype="float32")
    cache = make_cache("paged", config, batch_size=2, block_size=4, dtype=torch.float64)
    with pytest.raises(ValueError, match="tokens"):
        begin_packed_step(cache, [0, 1], [2, 1], [5, 6], torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 1 token"):
        begin_packed_step(cache, [0], [0], [], torch.device("cpu"))
    with pytest.raises(ValueError, match="max_seq_len"):
        begin_packed_step(cache, [0, 1], [2, 40], [1] * 42, torch.device("cpu"))
    assert cache.sequences() == []  # the failed reserve allocated nothing

    class Unaddressable:  # the KVCache contract without block addressing
        layout = cache.layout

    with pytest.raises(TypeError, match="block-addressable"):
        begin_packed_step(Unaddressable(), [0], [1], [1], torch.device("cpu"))  # type: ignore[arg-type]
