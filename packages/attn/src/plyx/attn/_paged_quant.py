"""``QuantizedPagedKVCache``: the paged cache with keys and values stored as int8 or float8_e4m3fn.

Same blocks, block tables, reference counts and copy-on-write as ``PagedKVCache`` (it is one, with other
pools); per layer it keeps::

    k_pool, v_pool:   [num_blocks, block_size, KV, Dh]   int8 | float8_e4m3fn
    k_scale, v_scale: [num_blocks, block_size, KV]       float32, one scale per token and key/value head

A stored row is ``q * scale`` (symmetric, ``scale = max|x| / 127`` for int8, ``/ 448`` for fp8_e4m3;
the definition and why the scales are per token and head: ``plyx.kernel.reference.store_kv_quant``).
Writes go through the ``store_kv_quant`` kernel; attention over the pools through ``paged_attention_quant``
(plyx-attn's ``Attention`` does both when ``kv_scales`` is present); ``read`` dequantises into the
layout's dtype (the model's), so the gathered prefill path and every reader of the contract work
unchanged. At Dh = 128 a token takes 132 bytes per head and side instead of 256 in bfloat16 (0.52x).

``layout.dtype`` stays the model's dtype (what reads return); ``kv_dtype`` is the storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from plyx.attn._common import check_kv
from plyx.attn._kernels import kernel
from plyx.attn._paged import PagedKVCache
from plyx.specs.kvcache import CacheLayout

__all__ = ["KV_CACHE_DTYPES", "QuantizedPagedKVCache", "check_kv_cache_dtype"]

#: storage dtypes by name (the names of plyx-serve's ``kv_cache_dtype``)
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
#: float8_e4m3fn conversions in the Triton kernels: Hopper (sm_90) or newer
FP8_MIN_CAPABILITY = (9, 0)


def check_kv_cache_dtype(kv_dtype: str, device: str | torch.device) -> torch.dtype:
    """The storage dtype of ``kv_dtype`` if ``device`` supports it; else a ``ValueError`` naming the fix.

    int8 runs everywhere (Triton on CUDA, the reference elsewhere). fp8_e4m3 runs on CPU (reference
    kernels; torch has the dtype) and on Hopper or newer GPUs; an older GPU or another device is refused.
    """
    if kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown quantised KV-cache dtype {kv_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(or an unquantised cache: kv_cache_dtype='auto' / 'bf16')")
    dev = torch.device(device)
    if kv_dtype == "fp8_e4m3":
        if dev.type == "cuda":
            cc = torch.cuda.get_device_capability(dev)
            if cc < FP8_MIN_CAPABILITY:
                name = torch.cuda.get_device_name(dev)
                raise ValueError(
                    f"kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability >= 9.0 (Hopper) for its float8 "
                    f"kernels; {dev} ({name}) is sm_{cc[0]}{cc[1]}. Use kv_cache_dtype='int8' (any GPU, the same "
                    f"memory) or 'bf16'")
        elif dev.type != "cpu":
            raise ValueError(f"kv_cache_dtype='fp8_e4m3' is supported on CPU and on Hopper GPUs, not on {dev.type}; "
                             f"use kv_cache_dtype='int8' there")
    return KV_CACHE_DTYPES[kv_dtype]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes: CPU index_copy_/index_select have no float8 kernels (moves are bitwise)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class QuantizedPagedKVCache(PagedKVCache):
    """A ``PagedKVCache`` storing keys and values as int8 or float8_e4m3fn with per-token, per-head scales.

    Args:
        layout: sizes (``block_size`` and ``num_blocks`` required); ``layout.dtype`` is what ``read`` returns.
        kv_dtype: ``"int8"`` (any device) or ``"fp8_e4m3"`` (CPU, Hopper GPUs).

    Example::

        cache = QuantizedPagedKVCache(layout, kv_dtype="int8")   # then as PagedKVCache
        k_pool, v_pool = cache.kv_pool(0)                        # int8 [num_blocks, block_size, KV, Dh]
        k_scale, v_scale = cache.kv_scales(0)                    # float32 [num_blocks, block_size, KV]
    """

    def __init__(self, layout: CacheLayout, *, kv_dtype: str = "int8") -> None:
        self._storage = check_kv_cache_dtype(kv_dtype, layout.device)
        self._kv_dtype = kv_dtype
        super().__init__(layout)

    @property
    def kv_dtype(self) -> str:
        """The storage dtype's name: ``int8`` or ``fp8_e4m3``."""
        return self._kv_dtype

    # -- the KVCache contract --------------------------------------------------------
    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots_for(seq_ids)
        self._check_layer(layer)
        check_kv(self._layout, k, v, slots.numel())
        self.write_slots(layer, slots, k, v)
        self._appended.add(layer)

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised keys and values ``[length, KV, Dh]`` in the layout's dtype."""
        self._check_layer(layer)
        seq = self._get(seq_id)
        kv = (self._layout.num_kv_heads, self._layout.head_dim)
        dtype = self._dtype()
        if not seq.blocks:
            empty = torch.empty((0, *kv), dtype=dtype, device=self._k[layer].device)
            return empty, empty.clone()
        table = torch.tensor(seq.blocks, dtype=torch.long, device=self._k[layer].device)
        out = []
        for pool, scale in ((self._k[layer], self._ks[layer]), (self._v[layer], self._vs[layer])):
            q = _raw(pool).index_select(0, table).view(pool.dtype).reshape(-1, *kv)[: seq.length]  # (length, KV, Dh)
            s = scale.index_select(0, table).reshape(-1, kv[0])[: seq.length]  # (length, KV)
            out.append(self._dequantize(q, s))
        return out[0], out[1]

    # -- quantised storage -----------------------------------------------------------
    def kv_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s scale pools, float32 ``[num_blocks, block_size, KV]`` each (beside ``kv_pool(layer)``)."""
        self._check_layer(layer)
        return self._ks[layer], self._vs[layer]

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise ``k``, ``v`` ``[N, KV, Dh]`` into the flat ``slots`` (int64 ``[N]``, negative: skipped) of
        ``layer``: ``append`` after a ``reserve``, or a static step's writes (``plyx.attn.StaticDecode``)."""
        kv = (self._layout.num_kv_heads, self._layout.head_dim)
        k_pool, v_pool = self._k[layer].view(-1, *kv), self._v[layer].view(-1, *kv)  # (num_blocks * block_size, KV, Dh)
        k_scale, v_scale = self._ks[layer].view(-1, kv[0]), self._vs[layer].view(-1, kv[0])  # (slots, KV)
        fn = kernel("store_kv_quant", k, v)
        fn(k, v, k_pool, v_pool, k_scale, v_scale, slots)

    def storage_roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What ``read`` returns for rows ``x [N, KV, Dh]`` once appended (quantised, then dequantised).

        The conformance kit compares reads with this exactly: it is the same kernel on a scratch buffer.
        """
        n, kv, dh = x.shape
        device = self._k[0].device if self._k else torch.device(self._layout.device)
        q = torch.empty((n, kv, dh), dtype=self._storage, device=device)
        s = torch.empty((n, kv), dtype=torch.float32, device=device)
        slots = torch.arange(n, device=device)
        kernel("store_kv_quant", x, x)(x, x, q, q.clone(), s, s.clone(), slots)
        return self._dequantize(q, s)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer: keys and values and their scales."""
        if not self._k:
            return 0
        values = self._k[0][0].numel() * self._k[0].element_size()
        scales = self._ks[0][0].numel() * self._ks[0].element_size()
        return 2 * self._layout.num_layers * (values + scales)

    # -- internals -------------------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        from plyx.attn._common import dtype_of

        return dtype_of(self._layout.dtype)

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``q * scale`` (float32 math) in the layout's dtype."""
        return (q.to(torch.float32) * scale[..., None]).to(self._dtype())

    def _allocate_pools(self, shape: tuple[int, int, int, int]) -> None:
        layers, device = self._layout.num_layers, self._layout.device
        self._k = [torch.zeros(shape, dtype=self._storage, device=device) for _ in range(layers)]
        self._v = [torch.zeros(shape, dtype=self._storage, device=device) for _ in range(layers)]
        self._ks = [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(layers)]
        self._vs = [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(layers)]

    def _copy_block(self, old: int, fresh: int) -> None:
        for pool in (*self._k, *self._v):
            _raw(pool)[fresh].copy_(_raw(pool)[old])
        for scale in (*self._ks, *self._vs):
            scale[fresh].copy_(scale[old])

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"QuantizedPagedKVCache(blocks {u.blocks_used}/{u.blocks_total} used, block_size={self._layout.block_size}, "
            f"sequences={u.num_sequences}, kv_dtype={self._kv_dtype}, dtype={self._layout.dtype})"
        )
