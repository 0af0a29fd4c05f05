"""Triton paged decode attention with split-K (flash-decoding).

The cache stores keys and values in pools ``[num_blocks, block_size, KV, Dh]``;
sequence b's token n lives in pool block ``block_tables[b, n // block_size]``
at slot ``n % block_size``.

One program per (sequence, key/value head, split). Its M rows are the
``GROUP * Tq`` queries that read that key/value head (every query head of the
GQA group times every new token), so each key/value byte is read once per
sequence and used by the whole group; M is padded to 16 for the tensor cores,
which costs nothing here because decode is bound by reading the cache.

Split-K: with few sequences the (sequence, head) grid would leave most of the
GPU idle on long contexts, so the context is cut into ``num_splits`` chunks.
Each split writes its unnormalised partial ``acc`` with its base-2 max and sum;
a second kernel combines them::

    m = max_s m_s;  l = sum_s l_s * 2^(m_s - m);  o = sum_s acc_s * 2^(m_s - m) / l

The number of splits depends only on B, KV, the table width and the GPU, so
no device-to-host sync (no ``context_lens.max()``) is needed; each program cuts
its own sequence's length into that many chunks (whole key tiles), so the
splits share the work of a sequence far shorter than its table.

Quantised pools (``QUANT``, ``paged_attention_quant``): int8 or float8_e4m3fn pools with a float32
scale per (token, kv head) in ``[num_blocks, block_size, KV]`` pools beside them. A stored key is
``k_int * s_k``, so ``q . k = (q . k_int) * s_k`` and ``sum_n p_n v_n = sum_n (p_n s_v,n) v_int,n``:
the 8-bit tiles go through the tensor cores as q's dtype (exact: every int8 and e4m3 value is a
bf16/fp16 number) and the scales multiply the ``[BM, BN]`` scores and probabilities instead of the
``[BN, D]`` tiles. The cache bytes read per key/value head halve; the program is otherwise unchanged.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from plyx.kernel.attention._checks import check_paged, check_paged_quant
from plyx.kernel.attention._tl import mm, mma, widen
from plyx.kernel.triton_ops._common import pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs
from plyx.kernel.triton_ops.store_kv_quant import check_fp8_device

__all__ = ["paged_attention", "paged_attention_quant", "num_splits_for"]

LOG2E = 1.4426950408889634


@triton.jit
def _paged_fwd(
    Q, K_POOL, V_POOL, K_SCALE, V_SCALE, BLOCK_TABLES, CONTEXT_LENS, OUT, PART_ACC, PART_ML,
    stride_qb, stride_qt, stride_qh,
    stride_kblk, stride_kslot, stride_kh,
    stride_vblk, stride_vslot, stride_vh,
    stride_ksblk, stride_ksslot, stride_vsblk, stride_vsslot,
    stride_bt_b,
    stride_ob, stride_ot, stride_oh,
    Tq, KV, qk_scale, window, table_width,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_TILES: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_GDC: tl.constexpr, QUANT: tl.constexpr,
    V_T: tl.constexpr,
):
    # programmatic dependent launch: the previous kernel may have written the new keys, q or the tables, so
    # nothing is read before the wait
    wait_for_inputs(USE_GDC)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // ROW_TILES  # axis 1: (key/value head, tile of BLOCK_M query rows)
    row_tile = tl.program_id(1) % ROW_TILES
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_n0 = tl.arange(0, BLOCK_N)
    table = BLOCK_TABLES + b * stride_bt_b
    max_ctx = table_width * BLOCK_SIZE
    L = tl.load(CONTEXT_LENS + b)

    # row r = g * Tq + t: head kvh * GROUP + g, new token t at position L - Tq + t
    offs_r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    g = offs_r // Tq
    t = offs_r % Tq
    row_ok = offs_r < GROUP * Tq
    h = kvh * GROUP + g
    pos = L - Tq + t
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BM, D]

    # this sequence's keys (from the window's first tile, if any) cut into num_splits chunks of whole tiles: the
    # splits share the sequence's own length, not the table's width, so a short sequence in a wide table (an
    # engine's max_model_len) still spreads over every split instead of landing whole in the first
    lo = 0
    if HAS_WINDOW:  # no key before the window's start is visible to any row
        lo = tl.maximum(L - Tq - window + 1, 0) // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(L - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, L)
    first = start + offs_n0
    blk = tl.load(table + first // BLOCK_SIZE, mask=first < max_ctx, other=0).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        valid = offs_n < end
        slot = offs_n % BLOCK_SIZE
        kt = tl.load(K_POOL + blk[None, :] * stride_kblk + slot[None, :] * stride_kslot + kvh * stride_kh
                     + offs_d[:, None], mask=valid[None, :], other=0.0)  # [D, BN]
        # the values are issued with the keys, not after the scores: at decode sizes the program is a chain
        # of memory round trips (length, block ids, keys, values), and this takes one out of it
        if V_T:
            # 8-bit values: loaded as [D, BN] and transposed in registers. Loaded as [BN, D], the 8-bit tile sat in
            # shared memory and the tensor cores' B operand (pairs of consecutive tokens) was gathered from it one
            # byte at a time (64 ld.shared.b8 per thread and 128-token tile, sm_90 PTX); transposed after the load,
            # the tile is widened in registers and read back with ldmatrix.trans like a bf16 one
            v = tl.trans(tl.load(V_POOL + blk[None, :] * stride_vblk + slot[None, :] * stride_vslot
                                 + kvh * stride_vh + offs_d[:, None], mask=valid[None, :], other=0.0))  # [BN, D]
        else:
            v = tl.load(V_POOL + blk[:, None] * stride_vblk + slot[:, None] * stride_vslot + kvh * stride_vh
                        + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BN, D]
        if QUANT:
            # int8 / fp8 pools, one float32 scale per (token, kv head): the integers (exact in 16 bits) go
            # through the tensor cores in q's dtype and the scales multiply the [BM, BN] scores and
            # probabilities, never the [BN, D] tiles (so the dequantisation costs 2 BN multiplies per row)
            ks = tl.load(K_SCALE + blk * stride_ksblk + slot * stride_ksslot + kvh, mask=valid, other=0.0)
            vs = tl.load(V_SCALE + blk * stride_vsblk + slot * stride_vsslot + kvh, mask=valid, other=0.0)
            kt = widen(kt, q.dtype)
            v = widen(v, q.dtype)
        following = offs_n + BLOCK_N  # the next tile's block ids, fetched while this one computes
        blk = tl.load(table + following // BLOCK_SIZE, mask=following < max_ctx, other=0).to(tl.int64)
        if QUANT:
            s = mm(q, kt) * (ks[None, :] * qk_scale)  # [BM, BN], base 2: (q . k_int) * k_scale
        else:
            s = mm(q, kt) * qk_scale  # [BM, BN], base 2
        allowed = valid[None, :] & (offs_n[None, :] <= pos[:, None])  # causal among the new tokens
        if HAS_WINDOW:
            allowed = allowed & ((pos[:, None] - offs_n[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            acc = mma((p * vs[None, :]).to(v.dtype), v, acc * alpha[:, None])  # sum_n p_n v_scale_n v_int_n
        else:
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    if SPLIT:
        # partials: PART_ACC [B, KV, splits, ROWS, D], PART_ML [B, KV, splits, 2, ROWS], ROWS = ROW_TILES * BM
        rows = ROW_TILES * BLOCK_M
        base = ((b * KV + kvh) * num_splits + split)
        tl.store(PART_ACC + base * rows * HEAD_DIM + offs_r[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.store(PART_ML + base * 2 * rows + offs_r, m_i)
        tl.store(PART_ML + base * 2 * rows + rows + offs_r, l_i)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(OUT + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _paged_combine(
    PART_ACC, PART_ML, OUT,
    stride_ob, stride_ot, stride_oh,
    Tq, KV, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # one program per (sequence, key/value head, row)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.program_id(2)
    g = r // Tq
    t = r % Tq
    h = kvh * GROUP + g
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    base = (b * KV + kvh) * num_splits + offs_s  # [BLOCK_S]
    m = tl.load(PART_ML + base * 2 * ROWS + r, mask=split_ok, other=float("-inf"))
    l_s = tl.load(PART_ML + base * 2 * ROWS + ROWS + r, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # 0 for empty splits
    l_tot = tl.sum(l_s * w, 0)
    acc = tl.load(PART_ACC + base[:, None] * ROWS * HEAD_DIM + r * HEAD_DIM + offs_d[None, :],
                  mask=split_ok[:, None], other=0.0)  # [BLOCK_S, D]
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(OUT + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, o.to(OUT.dtype.element_ty))


def _empty(shape, *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every output and workspace comes from here, so tests can poison them (each element must be written)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: launch configs on a GPU (key tile, warps, pipeline depth), from the benchmark (H100, 2026-11-22):
#: split-K runs many short programs, which hide latency better with 64-token tiles (two programs
#: fit an SM: 5-15% faster at batch 1 and 8); one long program per (sequence, head) streams best
#: with 128-token tiles (3-4% faster at batch 64)
GPU_CONFIG_SPLIT = {"block_n": 64, "num_warps": 4, "num_stages": 3}
GPU_CONFIG_SINGLE = {"block_n": 128, "num_warps": 4, "num_stages": 3}
#: quantised pools: the same grid and split count, twice the tokens per tile. An 8-bit tile cannot go from
#: global memory straight into the tensor cores' shared-memory operands as a bf16 tile does (it is widened in
#: registers first), so each key tile is a serial round trip; at 64 tokens the program made as many of them
#: as the bf16 one for half the bytes (H100, batch 16 at 8k: 367 against 751 GB/s, 2026-11-24). 128 tokens of
#: int8 are the bytes of 64 of bf16; ``bench_kv_quant.py --mode kernel --sweep`` measures the alternatives
#: ``v_trans``: values loaded transposed (see ``_paged_fwd``: no byte-wise shared-memory reads of 8-bit tiles)
GPU_CONFIG_QUANT_SPLIT = {"block_n": 128, "num_warps": 4, "num_stages": 3, "v_trans": 1}
GPU_CONFIG_QUANT_SINGLE = {"block_n": 128, "num_warps": 4, "num_stages": 3, "v_trans": 1}
#: the keys a launch config takes (``paged_attention(config=...)``)
CONFIG_KEYS = frozenset({"block_n", "num_warps", "num_stages", "v_trans"})
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: small, so that tests exercise the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def num_splits_for(batch: int, kv_heads: int, max_context: int, block_n: int, sm_count: int) -> int:
    """Splits so that about two programs run per multiprocessor, each with at least 4 key tiles.

    Once the (sequence, head) programs alone are half the multiprocessors or more, only long tables split: at 32
    sequences x 4 heads on an H100 (128 programs, 132 SMs, a 45-column table) every split count from 2 to 8 was
    slower than none at contexts 64 to 700 (5.9 against 8.0 us at 64, 13.1 against 14.9 at 512;
    ``bench_paged_attention.py --engine-shape``, 2026-11-25): the partials and the combine cost more than the
    shorter chains save until a sequence holds thousands of tokens."""
    programs = batch * kv_heads
    tiles = triton.cdiv(max_context, block_n)
    if programs >= sm_count or tiles < 8 or (2 * programs >= sm_count and tiles < 32):
        return 1
    return max(1, min(triton.cdiv(2 * sm_count, programs), tiles // 4, 64))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The ``paged_attention`` contract (see ``paged_attention_reference``) in Triton.

    ``num_splits`` forces the split-K factor (1 = no split); by default it is
    chosen from the batch, the heads, the table width and the GPU's size.
    Context lengths are trusted (no host sync): each must be >= Tq and fit the table.
    With ``k_scale``/``v_scale`` (``[num_blocks, block_size, KV]`` float32) the pools are
    int8 / float8_e4m3fn and are dequantised in registers (``paged_attention_quant``).
    ``config`` overrides the GPU launch config (``block_n``, ``num_warps``, ``num_stages``; benchmarks).
    """
    quant = k_scale is not None
    if quant:
        B, Tq, H, KV, D, block_size = check_paged_quant(q, k_pool, v_pool, k_scale, v_scale, block_tables,
                                                        context_lens)
        check_fp8_device("paged_attention_quant:triton", "k_pool", k_pool)
    else:
        B, Tq, H, KV, D, block_size = check_paged(q, k_pool, v_pool, block_tables, context_lens)
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"paged_attention: head_dim={D} must be a power of two in [16, 256]; use the reference")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_attention: k_pool/v_pool need a unit stride on head_dim; pass the cache's own pools")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block_size={block_size} must be a power of two")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: `window` must be >= 1, got {window}")
    group = H // KV
    # a program takes at most 128 query rows (GQA group x new tokens); more go to further row tiles
    block_m = min(max(16, triton.next_power_of_2(group * Tq)), 128)
    row_tiles = triton.cdiv(group * Tq, block_m)
    scale = float(D**-0.5 if scale is None else scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32) if block_tables.dtype != torch.int32 else block_tables
    context_lens = context_lens.to(torch.int32) if context_lens.dtype != torch.int32 else context_lens
    interp = _interpreting()
    max_context = block_tables.shape[1] * block_size
    split_cfg, single_cfg = (GPU_CONFIG_QUANT_SPLIT, GPU_CONFIG_QUANT_SINGLE) if quant else (GPU_CONFIG_SPLIT,
                                                                                           GPU_CONFIG_SINGLE)
    if config is not None:
        if set(config) - CONFIG_KEYS:
            raise ValueError(f"paged_attention: unknown launch config keys {sorted(set(config) - CONFIG_KEYS)}; "
                             f"use {sorted(CONFIG_KEYS)}")
        split_cfg = single_cfg = {**split_cfg, **config}
    # the split count comes from the bf16 kernel's 64-token tiles whatever the tile: the same grid (B x KV x
    # splits) for every storage, so that batch 16 at 8k fills the GPU alike (16-token tiles in the interpreter)
    if num_splits is None:
        num_splits = num_splits_for(B, KV, max_context, 16 if interp else GPU_CONFIG_SPLIT["block_n"],
                                    _sm_count(q.device))
    if interp:  # small tiles; the value layout of the GPU config (both layouts are tested)
        config = {"block_n": 16, "num_warps": 4, "num_stages": 1, "v_trans": split_cfg.get("v_trans", 0)}
    else:
        config = single_cfg if num_splits <= 1 else split_cfg
    block_n = config["block_n"] if D <= 128 else min(config["block_n"], 32)
    num_splits = max(1, min(int(num_splits), triton.cdiv(max_context, block_n)))
    o = _empty(q.shape, like=q)
    split = num_splits > 1
    gdc = pdl(q.device)
    if split:
        part_acc = _empty((B, KV, num_splits, row_tiles * block_m, D), like=q, dtype=torch.float32)
        part_ml = _empty((B, KV, num_splits, 2, row_tiles * block_m), like=q, dtype=torch.float32)
    else:
        part_acc = part_ml = o  # never touched: SPLIT is False
    ks, vs = (k_scale, v_scale) if quant else (k_pool, v_pool)  # never read without QUANT
    _paged_fwd[(B, KV * row_tiles, num_splits)](
        q, k_pool, v_pool, ks, vs, block_tables, context_lens, o, part_acc, part_ml,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        block_tables.stride(0),
        o.stride(0), o.stride(1), o.stride(2),
        Tq, KV, scale * LOG2E, window or 0, block_tables.shape[1],
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, ROW_TILES=row_tiles,
        SPLIT=split, HAS_WINDOW=window is not None, USE_GDC=gdc, QUANT=quant,
        V_T=bool(config.get("v_trans", 0)), num_warps=config["num_warps"],
        num_stages=config["num_stages"], launch_pdl=gdc,
    )
    if split:
        _paged_combine[(B, KV, group * Tq)](
            part_acc, part_ml, o, o.stride(0), o.stride(1), o.stride(2), Tq, KV, num_splits,
            GROUP=group, HEAD_DIM=D, ROWS=row_tiles * block_m, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return o


def paged_attention_quant(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The ``paged_attention_quant`` contract (see ``paged_attention_quant_reference``) in Triton: the paged
    kernel above with int8 / float8_e4m3fn pools dequantised in registers (float8 on Hopper or newer).
    ``config`` overrides the GPU launch config (``GPU_CONFIG_QUANT_SPLIT`` / ``_SINGLE``; benchmarks)."""
    return paged_attention(q, k_pool, v_pool, block_tables, context_lens, scale=scale, window=window,
                           num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, config=config)
