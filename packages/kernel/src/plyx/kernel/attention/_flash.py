"""Triton flash attention, forward and backward (FlashAttention-2 style).

Forward (one program per block of BLOCK_M queries of one head)::

    for each block of BLOCK_N keys j:
        s    = (q @ k_j^T) * scale * log2(e)               # [BM, BN], base-2 logits
        m'   = max(m, rowmax(s));  p = exp2(s - m')
        l    = l * exp2(m - m') + rowsum(p)
        acc  = acc * exp2(m - m') + p @ v_j
    o = acc / l;  lse2 = m + log2(l)                         # saved for the backward

No [T, S] matrix exists in memory; only o and lse2 [B, H, T] are written.

Backward (Dao 2023, Algorithm 2), with D = rowsum(dO * O)::

    P  = exp2(s - lse2)                 dV = P^T dO
    dP = dO V^T                         dS = P * (dP - D)
    dQ = scale * dS K                   dK = scale * dS^T Q

Two kernels, neither with atomics: one program per key block of a key/value
head accumulates dK and dV over every query head of its GQA group (so the
repeated K/V heads are never materialised), one program per query block
accumulates dQ.

Launch configurations (``FlashConfig``; ``VARIANTS`` names them, ``BEST`` picks one per head_dim and causal
flag, ``use_config`` overrides) switch on the Hopper techniques of FlashAttention-3 that Triton expresses:
TMA descriptor loads, warp-specialised loops, a persistent forward grid, and the single-pass backward that
adds dQ in float32 atomics from the dK/dV kernel instead of launching the dQ kernel.

Key blocks fall in three kinds per query block: fully visible (no masking
work), partially visible (causal diagonal, window edge, sequence end) and
invisible (skipped). Documents and user masks make every block "partial".
Masked logits are -inf; rows that see nothing keep l = 0 and give o = 0, and
their lse2 is stored as +inf so that the backward's P = exp2(s - lse2) is 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from plyx.kernel.attention._checks import check_attention
from plyx.kernel.attention._tl import mm, mma

__all__ = [
    "BEST", "VARIANTS", "FlashAttentionFunction", "FlashConfig", "Tile", "config_for", "flash_attention",
    "flash_attention_backward", "flash_attention_saving", "use_config",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def _empty(shape, *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every output and workspace comes from here, so tests can poison them (each element must be written)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _autotuning() -> bool:
    # Off by default: tuning compiles every config of _FWD/_DKDV/_DQ_CONFIGS for each new
    # combination of flags (about a minute on an H100), and the defaults below are the tuner's
    # winners at T >= 4k. PLYX_ATTENTION_AUTOTUNE=1 turns it on (the benchmark reports both).
    # The interpreter never tunes (it would time numpy).
    return not _interpreting() and os.environ.get("PLYX_ATTENTION_AUTOTUNE", "0") == "1"


# --------------------------------------------------------------------------- forward


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q,
    k_src, v_src, stride_ks, stride_vs,
    bias_base, stride_bias_t, stride_bias_s,
    docs_base, doc_q,
    offs_m, pos_m, offs_d,
    lo, hi, T, S, qk_scale, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False, WS: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    # k_src / v_src: the head's K and V base pointers, or (TMA) their [S, D] descriptors, which zero-fill
    # rows past S (the masked blocks still mask those keys' logits).
    # FOLD (scale > 0, no bias): s, m_i and m_new stay in raw q.k units and the scale enters the exponent,
    # exp2(s * scale - m * scale): one FMA per logit instead of a multiply (s is read twice, by the row max
    # and the exponent, so the compiler cannot fuse the two) and a subtract
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        if TMA:
            kt = tl.trans(k_src.load([start_n, 0]))  # [D, BN]
        else:
            kt_ptrs = k_src + offs_n[None, :] * stride_ks + offs_d[:, None]  # [D, BN]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=offs_n[None, :] < S, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
        if FOLD:
            s = mm(q, kt)  # [BM, BN], raw q.k (the base-2 scale goes into the exponent)
        else:
            s = mm(q, kt) * qk_scale  # [BM, BN], base-2 logits
        if MASKED:
            allowed = offs_n[None, :] < S
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= pos_m[:, None])
            if HAS_WINDOW:
                allowed = allowed & ((pos_m[:, None] - offs_n[None, :]) < window)
            if HAS_DOCS:
                doc_k = tl.load(docs_base + offs_n, mask=offs_n < S, other=-1)
                allowed = allowed & (doc_q[:, None] == doc_k[None, :])
            if HAS_BIAS:
                bias = tl.load(
                    bias_base + offs_m[:, None] * stride_bias_t + offs_n[None, :] * stride_bias_s,
                    mask=(offs_m[:, None] < T) & (offs_n[None, :] < S),
                    other=0.0,
                )
                s = s + bias.to(tl.float32) * 1.4426950408889634
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen only masked keys keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        if FOLD:
            p = tl.math.exp2(s * qk_scale - (m_use * qk_scale)[:, None])
            alpha = tl.math.exp2((m_i - m_use) * qk_scale)
        else:
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_src.load([start_n, 0])  # [BN, D]
        else:
            v_ptrs = v_src + offs_n[:, None] * stride_vs + offs_d[None, :]  # [BN, D]
            if MASKED:
                v = tl.load(v_ptrs, mask=offs_n[:, None] < S, other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = mma(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_range(start_m, T, S, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ALL_MASKED: tl.constexpr):
    """[lo, full_lo) partial, [full_lo, full_hi) fully visible, [full_hi, hi) partial key blocks."""
    p0 = start_m * BLOCK_M + (S - T)  # position of the block's first query
    p1 = p0 + BLOCK_M - 1  # position of its last (possibly padding) query
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, p1 + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, p0 - window + 1) // BLOCK_N * BLOCK_N
    if ALL_MASKED:
        full_lo = hi
        full_hi = hi
    else:
        full_lo = lo
        if HAS_WINDOW:
            full_lo = tl.maximum(lo, (tl.maximum(p1 - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        full_hi = S // BLOCK_N * BLOCK_N
        if CAUSAL:
            full_hi = tl.minimum(full_hi, (p0 + 1) // BLOCK_N * BLOCK_N)
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi



@triton.jit
def _fwd_tile(
    start_m, off_bh,
    Q, K, V, OUT, LSE2, BIAS, DOCS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s,
    stride_docs_b,
    T, S, H, qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, FOLD: tl.constexpr,
):
    """One block of BLOCK_M queries of one (batch, head): o and lse2."""
    b = off_bh // H
    h = off_bh % H
    kvh = h // GROUP  # GQA: the key/value head this query head reads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    pos_m = offs_m + (S - T)  # queries are the last T of the S positions

    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    o_base = OUT + b * stride_ob + h * stride_oh
    if TMA:
        # this head's [T, D] / [S, D] rows as TMA descriptors: bulk async copies into shared memory, the
        # hardware clips at T and S (zero-filled loads, clipped stores), no address arithmetic per element
        q_desc = tl.make_tensor_descriptor(q_base, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(k_base, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_base, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        q = q_desc.load([start_m * BLOCK_M, 0])  # [BM, D]
    else:
        k_src = k_base
        v_src = v_base
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    bias_base = BIAS + b * stride_bias_b + h * stride_bias_h
    docs_base = DOCS + b * stride_docs_b
    doc_q = offs_m  # placeholder when there are no documents
    if HAS_DOCS:
        doc_q = tl.load(docs_base + offs_m, mask=offs_m < T, other=-2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_range(start_m, T, S, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW,
                                          HAS_DOCS or HAS_BIAS)
    # masked blocks before, unmasked in the middle, masked after (the causal diagonal): the mask and its
    # compares run only where they can change something
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                                bias_base, stride_bias_t, stride_bias_s, docs_base, doc_q,
                                offs_m, pos_m, offs_d, lo, full_lo, T, S, qk_scale, window,
                                BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS, FOLD)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                                bias_base, stride_bias_t, stride_bias_s, docs_base, doc_q,
                                offs_m, pos_m, offs_d, full_lo, full_hi, T, S, qk_scale, window,
                                BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS, FOLD)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, stride_ks, stride_vs,
                                bias_base, stride_bias_t, stride_bias_s, docs_base, doc_q,
                                offs_m, pos_m, offs_d, full_hi, hi, T, S, qk_scale, window,
                                BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS, FOLD)
    if FOLD:
        m_i = m_i * qk_scale  # to base-2 logits (-inf stays -inf: the scale is positive)

    empty = l_i == 0.0  # rows with nothing to attend to: o = 0, lse2 = +inf (see module docstring)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE2 + off_bh * T + offs_m, lse2, mask=offs_m < T)
    if TMA:
        o_desc = tl.make_tensor_descriptor(o_base, shape=[T, HEAD_DIM], strides=[stride_ot, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        o_desc.store([start_m * BLOCK_M, 0], o.to(OUT.dtype.element_ty))
    else:
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], o.to(OUT.dtype.element_ty),
                 mask=offs_m[:, None] < T)


@triton.jit
def _attn_fwd(
    Q, K, V, OUT, LSE2, BIAS, DOCS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s,
    stride_docs_b,
    T, S, H, N_BH, qk_scale, window, TUNE_T, TUNE_S,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False, WS: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
    FOLD: tl.constexpr = False,
):
    if PERSISTENT:
        # a fixed grid of programs walks the (query block, batch*head) tiles, the last query blocks first:
        # under a causal mask they have the most keys, so the long tiles start early and short ones fill the tail
        num_m = tl.cdiv(T, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * N_BH, tl.num_programs(0)):
            _fwd_tile(num_m - 1 - tile // N_BH, tile % N_BH, Q, K, V, OUT, LSE2, BIAS, DOCS,
                      stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh,
                      stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s, stride_docs_b,
                      T, S, H, qk_scale, window, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N,
                      CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS, FOLD)
    else:
        _fwd_tile(tl.program_id(0), tl.program_id(1), Q, K, V, OUT, LSE2, BIAS, DOCS,
                  stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh,
                  stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s, stride_docs_b,
                  T, S, H, qk_scale, window, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N,
                  CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS, FOLD)


# --------------------------------------------------------------------------- backward


@triton.jit
def _bwd_preprocess(OUT, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh,
                    T, H, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    # DELTA[b, h, t] = sum_d dO * O  (the D of the backward), float32
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < T
    o = tl.load(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=rows,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + off_bh * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v,
    q_src, do_src, stride_qt, stride_dot,
    lse_base, delta_base,
    bias_base, stride_bias_t, stride_bias_s,
    docs_base, doc_k,
    offs_n, offs_d,
    lo, hi, T, S, qk_scale, window,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    dq_base, stride_dqt,
    TMA: tl.constexpr = False, WS: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False,
):
    # q_src / do_src: the query head's Q and dO base pointers, or (TMA) their [T, D] descriptors.
    # ATOMIC_DQ: also dQ += dS K for these query rows, added in float32 to dq_base (FA2/FA3's single pass:
    # 5 products per tile instead of 7 with the separate dQ kernel, paid in float32 atomics)
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        rows = offs_m < T
        if TMA:
            q = q_src.load([start_m, 0])  # zero past T
        else:
            q_ptrs = q_src + offs_m[:, None] * stride_qt + offs_d[None, :]
            if MASKED:
                q = tl.load(q_ptrs, mask=rows[:, None], other=0.0)
            else:
                q = tl.load(q_ptrs)
        if MASKED:
            lse2 = tl.load(lse_base + offs_m, mask=rows, other=float("inf"))
        else:
            lse2 = tl.load(lse_base + offs_m)
        st = mm(k, tl.trans(q)) * qk_scale  # [BN, BM] = s^T, base 2
        if MASKED:
            pos_m = offs_m + (S - T)
            allowed = (offs_n[:, None] < S) & (offs_m[None, :] < T)
            if CAUSAL:
                allowed = allowed & (offs_n[:, None] <= pos_m[None, :])
            if HAS_WINDOW:
                allowed = allowed & ((pos_m[None, :] - offs_n[:, None]) < window)
            if HAS_DOCS:
                doc_q = tl.load(docs_base + offs_m, mask=offs_m < T, other=-2)
                allowed = allowed & (doc_k[:, None] == doc_q[None, :])
            if HAS_BIAS:
                bias = tl.load(
                    bias_base + offs_m[None, :] * stride_bias_t + offs_n[:, None] * stride_bias_s,
                    mask=(offs_m[None, :] < T) & (offs_n[:, None] < S),
                    other=0.0,
                )
                st = st + bias.to(tl.float32) * 1.4426950408889634
            st = tl.where(allowed, st, float("-inf"))
        pt = tl.math.exp2(st - lse2[None, :])  # P^T [BN, BM]
        if TMA:
            do = do_src.load([start_m, 0])
        else:
            do_ptrs = do_src + offs_m[:, None] * stride_dot + offs_d[None, :]
            if MASKED:
                do = tl.load(do_ptrs, mask=rows[:, None], other=0.0)
            else:
                do = tl.load(do_ptrs)
        if MASKED:
            delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        else:
            delta = tl.load(delta_base + offs_m)
        dv = mma(pt.to(do.dtype), do, dv)  # dV += P^T dO
        dpt = mm(v, tl.trans(do))  # dP^T = V dO^T  [BN, BM]
        dst = pt * (dpt - delta[None, :])  # dS^T
        dk = mma(dst.to(q.dtype), q, dk)  # dK += dS^T Q  (scale applied at the end)
        if ATOMIC_DQ:
            dq = mm(tl.trans(dst.to(k.dtype)), k)  # dQ rows += dS K  [BM, D]  (scale applied at the end)
            dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :]
            if MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=rows[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, BIAS, DOCS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s,
    stride_docs_b,
    DQ_ACC, stride_dqb, stride_dqt, stride_dqh,
    T, S, H, KV, qk_scale, sm_scale, window, TUNE_T, TUNE_S,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False, WS: tl.constexpr = False, ATOMIC_DQ: tl.constexpr = False,
):
    start_n = tl.program_id(0)
    off_bkv = tl.program_id(1)
    b = off_bkv // KV
    kvh = off_bkv % KV
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols = offs_n[:, None] < S
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    if TMA:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        k = k_desc.load([start_n * BLOCK_N, 0])
        v = v_desc.load([start_n * BLOCK_N, 0])
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=cols, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=cols, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    docs_base = DOCS + b * stride_docs_b
    doc_k = offs_n  # placeholder when there are no documents
    if HAS_DOCS:
        doc_k = tl.load(docs_base + offs_n, mask=offs_n < S, other=-1)

    # Query blocks that see this key block: index m at position p = m + S - T.
    off = S - T
    n0 = start_n * BLOCK_N
    n1 = n0 + BLOCK_N - 1
    lo = 0
    if CAUSAL:
        lo = tl.maximum(n0 - off, 0) // BLOCK_M * BLOCK_M
    hi = T
    if HAS_WINDOW:
        hi = tl.minimum(T, tl.maximum(n1 + window - off, 0))  # p <= n1 + window - 1
    if HAS_DOCS or HAS_BIAS:
        full_lo = hi
        full_hi = hi
    else:
        full_lo = lo
        if CAUSAL:  # every query of the block at or after the block's last key
            full_lo = tl.maximum(lo, (tl.maximum(n1 - off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        full_hi = T // BLOCK_M * BLOCK_M
        if HAS_WINDOW:  # the block's last query within the window of its first key
            full_hi = tl.minimum(full_hi, tl.maximum(window + n0 - off, 0) // BLOCK_M * BLOCK_M)
        full_lo = tl.where(n1 >= S, hi, full_lo)  # the sequence ends inside this key block: all partial
        full_lo = tl.minimum(full_lo, hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    for g in range(GROUP):  # every query head of this key/value head's group
        h = kvh * GROUP + g
        off_bh = b * H + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        if TMA:
            q_src = tl.make_tensor_descriptor(q_base, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                              block_shape=[BLOCK_M, HEAD_DIM])
            do_src = tl.make_tensor_descriptor(do_base, shape=[T, HEAD_DIM], strides=[stride_dot, 1],
                                               block_shape=[BLOCK_M, HEAD_DIM])
        else:
            q_src = q_base
            do_src = do_base
        lse_base = LSE2 + off_bh * T
        delta_base = DELTA + off_bh * T
        bias_base = BIAS + b * stride_bias_b + h * stride_bias_h
        dq_base = DQ_ACC + b * stride_dqb + h * stride_dqh
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, stride_qt, stride_dot, lse_base, delta_base,
                              bias_base, stride_bias_t, stride_bias_s, docs_base, doc_k, offs_n, offs_d,
                              lo, full_lo, T, S, qk_scale, window,
                              BLOCK_M, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS,
                              dq_base, stride_dqt, TMA, WS, ATOMIC_DQ)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, stride_qt, stride_dot, lse_base, delta_base,
                              bias_base, stride_bias_t, stride_bias_s, docs_base, doc_k, offs_n, offs_d,
                              full_lo, full_hi, T, S, qk_scale, window,
                              BLOCK_M, False, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS,
                              dq_base, stride_dqt, TMA, WS, ATOMIC_DQ)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, stride_qt, stride_dot, lse_base, delta_base,
                              bias_base, stride_bias_t, stride_bias_s, docs_base, doc_k, offs_n, offs_d,
                              full_hi, hi, T, S, qk_scale, window,
                              BLOCK_M, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS,
                              dq_base, stride_dqt, TMA, WS, ATOMIC_DQ)

    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=cols)
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=cols)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta,
    k_src, v_src, stride_ks, stride_vs,
    bias_base, stride_bias_t, stride_bias_s,
    docs_base, doc_q,
    offs_m, pos_m, offs_d,
    lo, hi, T, S, qk_scale, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False, WS: tl.constexpr = False,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        if TMA:
            kt = tl.trans(k_src.load([start_n, 0]))  # [D, BN], zero past S
            vt = tl.trans(v_src.load([start_n, 0]))
        else:
            kt_ptrs = k_src + offs_n[None, :] * stride_ks + offs_d[:, None]  # [D, BN]
            vt_ptrs = v_src + offs_n[None, :] * stride_vs + offs_d[:, None]  # [D, BN]
            if MASKED:
                kt = tl.load(kt_ptrs, mask=offs_n[None, :] < S, other=0.0)
                vt = tl.load(vt_ptrs, mask=offs_n[None, :] < S, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
        s = mm(q, kt) * qk_scale  # [BM, BN]
        if MASKED:
            allowed = offs_n[None, :] < S
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= pos_m[:, None])
            if HAS_WINDOW:
                allowed = allowed & ((pos_m[:, None] - offs_n[None, :]) < window)
            if HAS_DOCS:
                doc_k = tl.load(docs_base + offs_n, mask=offs_n < S, other=-1)
                allowed = allowed & (doc_q[:, None] == doc_k[None, :])
            if HAS_BIAS:
                bias = tl.load(
                    bias_base + offs_m[:, None] * stride_bias_t + offs_n[None, :] * stride_bias_s,
                    mask=(offs_m[:, None] < T) & (offs_n[None, :] < S),
                    other=0.0,
                )
                s = s + bias.to(tl.float32) * 1.4426950408889634
            s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = mm(do, vt)  # dP = dO V^T  [BM, BN]
        ds = p * (dp - delta[:, None])
        dq = mma(ds.to(kt.dtype), tl.trans(kt), dq)  # dQ += dS K  (scale applied at the end)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE2, DELTA, DQ, BIAS, DOCS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    stride_bias_b, stride_bias_h, stride_bias_t, stride_bias_s,
    stride_docs_b,
    T, S, H, qk_scale, sm_scale, window, TUNE_T, TUNE_S,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr = False, WS: tl.constexpr = False,
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    kvh = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    pos_m = offs_m + (S - T)
    rows = offs_m < T
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=rows[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=rows[:, None], other=0.0)
    lse2 = tl.load(LSE2 + off_bh * T + offs_m, mask=rows, other=float("inf"))
    delta = tl.load(DELTA + off_bh * T + offs_m, mask=rows, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    if TMA:
        k_src = tl.make_tensor_descriptor(k_base, shape=[S, HEAD_DIM], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_base, shape=[S, HEAD_DIM], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_src = k_base
        v_src = v_base
    bias_base = BIAS + b * stride_bias_b + h * stride_bias_h
    docs_base = DOCS + b * stride_docs_b
    doc_q = offs_m
    if HAS_DOCS:
        doc_q = tl.load(docs_base + offs_m, mask=rows, other=-2)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_range(start_m, T, S, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW,
                                          HAS_DOCS or HAS_BIAS)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, bias_base, stride_bias_t,
                    stride_bias_s, docs_base, doc_q, offs_m, pos_m, offs_d, lo, full_lo, T, S, qk_scale, window,
                    BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, bias_base, stride_bias_t,
                    stride_bias_s, docs_base, doc_q, offs_m, pos_m, offs_d, full_lo, full_hi, T, S, qk_scale, window,
                    BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, stride_ks, stride_vs, bias_base, stride_bias_t,
                    stride_bias_s, docs_base, doc_q, offs_m, pos_m, offs_d, full_hi, hi, T, S, qk_scale, window,
                    BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_DOCS, HAS_BIAS, TMA, WS)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=rows[:, None])


# --------------------------------------------------------------------------- launch configs


class Tile(NamedTuple):
    """One kernel's launch shape: BLOCK_M x BLOCK_N tiles, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FlashConfig:
    """How the three kernels launch: tiles, and the Hopper (sm_90) techniques of FlashAttention-3 that
    Triton expresses, each a switch so that one sweep times them against the plain kernel.

    Attributes:
        fwd: the forward's tile (queries x keys per step).
        dkdv: the dK/dV kernel's tile (queries per step x keys per program).
        dq: the dQ kernel's tile (queries per program x keys per step).
        tma: Q, K, V, dO and O tiles through TMA tensor descriptors (``tl.make_tensor_descriptor``: bulk
            asynchronous copies that the hardware bounds-checks) instead of pointer loads; sm_90+ and
            16-byte aligned strides, else the pointer loads.
        warp_specialize: ``tl.range(..., warp_specialize=True)`` on the forward's and dQ's key loops
            (producer warps issue the loads, consumer warps the products and the softmax), where the Triton
            build does it: Triton 3.6 and 3.9 emit the same sm_90 PTX with it as without (their automatic
            warp specialisation targets Blackwell), so on Hopper it changes nothing yet. Not on the dK/dV loop: Triton 3.9's sm_90 warp specialisation aborts there ("unsupported
            load type for producer commit": the per-row lse/delta pointer loads beside the tiles).
        persistent: forward programs per SM of a persistent grid walking the tiles, longest first
            (0: one program per tile).
        atomic_dq: one backward pass (FA2/FA3): the dK/dV kernel also adds dS K into a float32 dQ with
            atomics, and the dQ kernel, with its recomputation of S and dP, is not launched.
        fold_scale: the forward keeps raw q.k logits and puts the scale into the exponent (one FMA per
            logit, as FA2/FA3's ``exp2(s * scale - m * scale)``) instead of scaling every logit first; for a
            positive scale without a mask bias (else the plain path).
    """

    fwd: Tile = Tile(128, 64, 8, 3)
    dkdv: Tile = Tile(32, 64, 4, 3)
    dq: Tile = Tile(128, 32, 4, 3)
    tma: bool = False
    warp_specialize: bool = False
    persistent: int = 0
    atomic_dq: bool = False
    fold_scale: bool = False


_BASE = FlashConfig()  # the tuner's winners for Dh 128, T >= 4k on an H100 (bench results 2026-11-22)
# the base of the new variants: the same with an 8-warp dQ (the 4-warp 128 x 32 dQ spills 152-176 bytes a thread
# at Dh 128 in an sm_90 compile by Triton 3.6, the GPU image's, 96-152 by 3.9; 8 warps keep it in ~140 registers)
_HOPPER = replace(_BASE, dq=Tile(128, 32, 8, 3))
# (the 64 x 128 dK/dV tile spills at 8 warps; 32 x 128 does not)
_BN128 = dict(fwd=Tile(128, 128, 8, 2), dkdv=Tile(32, 128, 8, 2), dq=Tile(128, 64, 8, 2))
#: the variants ``bench/attention/sweep_flash_sm90.py`` times, by name
VARIANTS: dict[str, FlashConfig] = {
    "baseline": _BASE,
    "dq-w8": _HOPPER,
    "tma": replace(_HOPPER, tma=True),
    # kept for a Triton that specialises these loops on sm_90: 3.6 and 3.9 emit the same PTX with and without
    # (compile_flash_sm90.py), so the sweep leaves it out unless named
    "tma-ws": replace(_HOPPER, tma=True, warp_specialize=True),
    "tma-persistent": replace(_HOPPER, tma=True, persistent=1),
    "bn128": replace(_HOPPER, **_BN128),
    # its dQ keeps the 128 x 32 tile: ptxas 12.x of Triton 3.6 crashes (signal 11) on the 128 x 64 one with TMA
    "tma-bn128": replace(_HOPPER, **{**_BN128, "dq": _HOPPER.dq}, tma=True),
    "stages4": replace(_HOPPER, fwd=Tile(128, 64, 8, 4), dkdv=Tile(32, 64, 4, 4), dq=Tile(128, 32, 8, 4)),
    "tma-stages4": replace(_HOPPER, fwd=Tile(128, 64, 8, 4), dkdv=Tile(32, 64, 4, 4), dq=Tile(128, 32, 8, 4),
                           tma=True),
    # FA3's forward tile at Dh 128 (128 x 128, three K/V stages: 225 KiB of the 227 KiB of shared memory)
    "tma-bn128-s3": replace(_HOPPER, fwd=Tile(128, 128, 8, 3), dkdv=Tile(32, 128, 8, 3), tma=True),
    "fold": replace(_HOPPER, fold_scale=True),
    "tma-fold": replace(_HOPPER, tma=True, fold_scale=True),
    "tma-bn128-s3-fold": replace(_HOPPER, fwd=Tile(128, 128, 8, 3), dkdv=Tile(32, 128, 8, 3), tma=True,
                                 fold_scale=True),
    # the dQ product adds a [BM, Dh] float32 tile to the dK/dV loop: 8 warps at 32 x 64 hold it without spilling
    "atomic-dq": replace(_HOPPER, dkdv=Tile(32, 64, 8, 3), atomic_dq=True),
    "tma-atomic-dq": replace(_HOPPER, dkdv=Tile(32, 64, 8, 3), atomic_dq=True, tma=True),
}
#: THE table to edit after a sweep: per (head_dim, causal), the VARIANTS name whose forward runs and the one
#: whose backward runs (the sweep prints both winners per key). Keys not listed run "baseline".
BEST: dict[tuple[int, bool], tuple[str, str]] = {
    (128, True): ("baseline", "baseline"),
    (128, False): ("baseline", "baseline"),
    (64, True): ("baseline", "baseline"),
    (64, False): ("baseline", "baseline"),
}
_INTERPRET_TILE = Tile(16, 16, 4, 1)
_INTERPRET_PROGRAMS = 3  # a persistent grid in the interpreter: 3 programs walk every tile
_OVERRIDE: ContextVar[FlashConfig | None] = ContextVar("plyx_flash_config", default=None)

#: (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on a GPU
_FWD_CONFIGS = [
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4),
    (128, 64, 8, 4), (128, 32, 8, 3), (64, 128, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 128, 8, 3),
]
_DKDV_CONFIGS = [
    (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (16, 128, 8, 3),
    (32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (32, 32, 4, 3), (64, 64, 8, 3), (32, 128, 4, 3), (16, 128, 4, 4),
]
_DQ_CONFIGS = [
    (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4),
    (128, 32, 8, 2), (128, 16, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4),
]
_TUNE_KEY = ["TUNE_T", "TUNE_S", "GROUP", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "HAS_DOCS", "HAS_BIAS"]


@contextmanager
def use_config(config: FlashConfig | str) -> Iterator[FlashConfig]:
    """Run every flash call inside the block with ``config`` (a ``FlashConfig`` or a ``VARIANTS`` name),
    forward and backward, whatever ``BEST`` says: what the sweep and the tests use.

    Args:
        config: the configuration or its name.

    Returns:
        A context manager yielding the configuration in force.
    """
    if isinstance(config, str):
        if config not in VARIANTS:
            raise KeyError(f"flash_attention: no variant {config!r}; the variants are {sorted(VARIANTS)}")
        config = VARIANTS[config]
    token = _OVERRIDE.set(config)
    try:
        yield config
    finally:
        _OVERRIDE.reset(token)


def config_for(head_dim: int, causal: bool, which: str) -> FlashConfig:
    """The configuration of the ``which`` pass ("fwd" or "bwd") at ``head_dim`` / ``causal``: the one of
    ``use_config`` when inside it, else ``BEST``'s entry (``baseline`` where it has none)."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    fwd, bwd = BEST.get((head_dim, causal), ("baseline", "baseline"))
    return VARIANTS[fwd if which == "fwd" else bwd]


def _configs(table: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in table]


_attn_fwd_tuned = triton.autotune(_configs(_FWD_CONFIGS), key=_TUNE_KEY)(_attn_fwd)
_attn_bwd_dkdv_tuned = triton.autotune(_configs(_DKDV_CONFIGS), key=_TUNE_KEY)(_attn_bwd_dkdv)
_attn_bwd_dq_tuned = triton.autotune(_configs(_DQ_CONFIGS), key=_TUNE_KEY)(_attn_bwd_dq)


def _launch(kernel, tuned, tile: Tile, grid_of, args: tuple, meta: dict) -> None:
    """Launch ``kernel`` tuned (tiles only; the switches in ``meta`` stay) or with ``tile``."""
    if _autotuning():
        tuned[lambda cfg: grid_of(cfg["BLOCK_M"], cfg["BLOCK_N"])](*args, **meta)
        return
    m, n, w, s = _INTERPRET_TILE if _interpreting() else tile
    kernel[grid_of(m, n)](*args, **meta, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)


def _bucket(n: int) -> int:
    # autotune key: the next power of two, so every new length does not re-tune
    return 1 << max(n - 1, 0).bit_length()


def _tma_usable(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need sm_90+, a unit inner stride, 16-byte aligned strides and bases (the per-head bases
    add multiples of the batch and head strides, so those must be aligned too)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    if _interpreting():
        return True
    dev = tensors[0].device
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the kernels write (``tl.make_tensor_descriptor``)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if _interpreting() else "cuda")


def _switches(cfg: FlashConfig, *tensors: torch.Tensor) -> dict[str, bool]:
    tma = cfg.tma and _tma_usable(*tensors)
    if tma:
        triton.set_allocator(_tma_scratch)
    return {"TMA": tma, "WS": cfg.warp_specialize and not _interpreting()}


def _programs(device: torch.device, per_sm: int) -> int:
    if _interpreting() or device.type != "cuda":
        return _INTERPRET_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def best_configs() -> dict[str, dict[str, object]]:
    """The autotuner's choice per key, for the benchmark's report."""
    out: dict[str, dict[str, object]] = {}
    for name, tuner in (("fwd", _attn_fwd_tuned), ("dkdv", _attn_bwd_dkdv_tuned), ("dq", _attn_bwd_dq_tuned)):
        for key, cfg in getattr(tuner, "cache", {}).items():
            # key: the _TUNE_KEY values, then the argument dtypes
            flags = dict(zip(_TUNE_KEY, key))
            label = " ".join(f"{k.lower().replace('tune_', '')}={v}" for k, v in flags.items())
            out[f"{name} {label}"] = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return out


# --------------------------------------------------------------------------- torch glue


def _bias_args(bias: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    if bias is None:
        return q, (0, 0, 0, 0)  # never read: HAS_BIAS is False
    strides = tuple(bias.stride(i) if bias.shape[i] > 1 else 0 for i in range(4))
    return bias, strides  # type: ignore[return-value]


def _forward(q, k, v, bias, docs, *, causal, scale, window):
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    o = _empty(q.shape, like=q)
    lse2 = _empty((B, H, T), like=q, dtype=torch.float32)
    bias_t, bias_strides = _bias_args(bias, q)
    docs_t = docs if docs is not None else q
    cfg = config_for(D, causal, "fwd")
    persistent = cfg.persistent > 0 and not _autotuning()
    meta = dict(GROUP=H // KV, HEAD_DIM=D, CAUSAL=causal, HAS_WINDOW=window is not None,
                HAS_DOCS=docs is not None, HAS_BIAS=bias is not None, **_switches(cfg, q, k, v, o),
                PERSISTENT=persistent, FOLD=cfg.fold_scale and scale > 0 and bias is None)
    args = (
        q, k, v, o, lse2, bias_t, docs_t,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        *bias_strides,
        docs.stride(0) if docs is not None else 0,
        T, S, H, B * H, scale * LOG2E, window or 0, _bucket(T), _bucket(S),
    )

    def grid(bm: int, bn: int) -> tuple[int, ...]:
        if persistent:
            return (min(triton.cdiv(T, bm) * B * H, _programs(q.device, cfg.persistent)),)
        return (triton.cdiv(T, bm), B * H)

    _launch(_attn_fwd, _attn_fwd_tuned, cfg.fwd, grid, args, meta)
    return o, lse2


def _backward(do, q, k, v, o, lse2, bias, docs, *, causal, scale, window):
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    do = do.contiguous() if do.stride(-1) != 1 else do
    delta = _empty(lse2.shape, like=lse2)
    pre_m = 16 if _interpreting() else 64
    _bwd_preprocess[(triton.cdiv(T, pre_m), B * H)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        T, H, HEAD_DIM=D, BLOCK_M=pre_m,
    )
    cfg = config_for(D, causal, "bwd")
    if cfg.atomic_dq and _autotuning():  # the tuner re-runs the kernel: its atomic sums would pile up
        cfg = replace(cfg, atomic_dq=False)
    dk, dv = _empty(k.shape, like=k), _empty(v.shape, like=v)
    # atomic dQ: float32 sums, zeroed (each row gets one add per key block that sees it)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if cfg.atomic_dq else _empty(q.shape, like=q)
    bias_t, bias_strides = _bias_args(bias, q)
    docs_t = docs if docs is not None else q
    docs_stride = docs.stride(0) if docs is not None else 0
    switches = _switches(cfg, q, k, v, do)
    meta = dict(GROUP=H // KV, HEAD_DIM=D, CAUSAL=causal, HAS_WINDOW=window is not None,
                HAS_DOCS=docs is not None, HAS_BIAS=bias is not None, **switches)
    common_tail = (*bias_strides, docs_stride)
    dkdv_args = (
        q, k, v, do, lse2, delta, dk, dv, bias_t, docs_t,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        *common_tail,
        dq, *((dq.stride(0), dq.stride(1), dq.stride(2)) if cfg.atomic_dq else (0, 0, 0)),
        T, S, H, KV, scale * LOG2E, scale, window or 0, _bucket(T), _bucket(S),
    )
    _launch(_attn_bwd_dkdv, _attn_bwd_dkdv_tuned, cfg.dkdv, lambda bm, bn: (triton.cdiv(S, bn), B * KV),
            dkdv_args, {**meta, "WS": False, "ATOMIC_DQ": cfg.atomic_dq})  # WS: see FlashConfig
    if cfg.atomic_dq:
        return (dq * scale).to(q.dtype), dk, dv
    dq_args = (
        q, k, v, do, lse2, delta, dq, bias_t, docs_t,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        *common_tail,
        T, S, H, scale * LOG2E, scale, window or 0, _bucket(T), _bucket(S),
    )
    _launch(_attn_bwd_dq, _attn_bwd_dq_tuned, cfg.dq, lambda bm, bn: (triton.cdiv(T, bm), B * H), dq_args, meta)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and lse2; the mask and documents get no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, docs, causal, scale, window):  # type: ignore[override]
        o, lse2 = _forward(q, k, v, bias, docs, causal=causal, scale=scale, window=window)
        ctx.save_for_backward(q, k, v, o, lse2, bias, docs)
        ctx.causal, ctx.scale, ctx.window = causal, scale, window
        ctx.mark_non_differentiable(lse2)
        return o, lse2

    @staticmethod
    def backward(ctx, do, _dlse2):  # type: ignore[override]
        q, k, v, o, lse2, bias, docs = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse2, bias, docs, causal=ctx.causal, scale=ctx.scale,
                               window=ctx.window)
        return dq, dk, dv, None, None, None, None, None


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _prepare(q, k, v, *, scale, mask, document_ids, window):
    """``(q, k, v, bias, docs, scale)`` as the kernels read them, after the contract's checks."""
    a = check_attention(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    if a.D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"flash_attention: head_dim={a.D} is not one of {SUPPORTED_HEAD_DIMS}; use the `sdpa` or `reference` "
            f"implementation (registry.override(attention='sdpa'))"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_attention: dtype {q.dtype} is not supported; use bfloat16 or float16")
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    bias = None
    if mask is not None:
        # one additive float32 bias [B|1, H|1, T, S]; a bool mask becomes 0 / -inf
        bias = (
            torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else mask.to(torch.float32)
        )
    docs = document_ids.to(torch.int32).contiguous() if document_ids is not None else None
    return q, k, v, bias, docs, a.scale


def flash_attention_saving(q, k, v, *, causal=True, scale=None, mask=None, document_ids=None, window=None):
    """``(o, lse2)``: the forward and its base-2 log-sum-exp ``[B, H, T]`` float32 (+inf on empty rows), the
    statistics ``flash_attention_backward`` needs: ``plyx::attention``'s custom op saves them instead of
    re-running this forward in its backward."""
    q, k, v, bias, docs, scale = _prepare(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    return _forward(q, k, v, bias, docs, causal=causal, scale=scale, window=window)


def flash_attention_backward(do, q, k, v, o, lse2, *, causal=True, scale=None, mask=None, document_ids=None,
                             window=None):
    """``(dq, dk, dv)`` from ``flash_attention_saving``'s ``o`` and ``lse2`` (the same options)."""
    q, k, v, bias, docs, scale = _prepare(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    return _backward(do, q, k, v, _unit_stride_last(o), lse2, bias, docs, causal=causal, scale=scale,
                     window=window)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``attention`` contract (see ``attention_reference``) in Triton, with gradients for q, k, v.

    Supports head_dim in {16, 32, 64, 128} (registered for 64 and 128), bfloat16
    and float16 (float32 accumulation), GQA/MQA, causal/full, T <= S (bottom-right),
    packed documents, sliding windows and bool/additive masks (no gradient to the mask).
    Launch configs are the built-in defaults (tuned on an H100 at Dh 128); set
    ``PLYX_ATTENTION_AUTOTUNE=1`` to autotune per flag combination and length bucket instead
    (about a minute of compilation the first time).
    """
    q, k, v, bias, docs, scale = _prepare(q, k, v, scale=scale, mask=mask, document_ids=document_ids, window=window)
    o, lse2 = FlashAttentionFunction.apply(q, k, v, bias, docs, causal, scale, window)
    if not return_lse:
        return o
    # base-2 and +inf for empty rows inside the kernels; natural log and -inf outside
    lse = torch.where(torch.isinf(lse2), torch.full_like(lse2, float("-inf")), lse2 * LN2)
    return o, lse
