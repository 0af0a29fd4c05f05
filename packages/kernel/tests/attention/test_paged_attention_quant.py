"""``paged_attention_quant``: paged decode attention over int8 / fp8_e4m3 pools with per-token, per-head scales.

The reference is checked against the per-sequence float64 oracle run on pools dequantised by hand; the
Triton kernel (the paged kernel with its QUANT path; interpreter on CPU) against the float64 reference on
the same quantised pools. Pools hold random data everywhere, tables are random permutations.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import registry
from plyx.kernel.attention import paged_attention_quant_reference, paged_attention_quant_triton
from plyx.kernel.attention._reference import paged_attention_per_sequence
from plyx.kernel.reference.store_kv_quant import quantize_kv

from .conftest import INTERPRETING, TRITON_DEVICE, rel_err

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
#: relative error against the float64 reference on the same quantised pools: the kernel's own roundings
#: (P, and P * v_scale, rounded once to q's dtype before the tensor cores)
TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def _inputs(lens, Tq, H, KV, D, block_size, dtype, storage, device="cpu", extra_blocks=3):
    B = len(lens)
    width = max(-(-n // block_size) for n in lens) + 1  # one spare column: never read
    num_blocks = B * width + extra_blocks
    # per-token magnitudes spread over 3 decades: the scales matter
    mag = torch.logspace(-1, 2, num_blocks * block_size).view(num_blocks, block_size, 1, 1)
    k, s_k = quantize_kv(torch.randn(num_blocks, block_size, KV, D) * mag, STORAGE[storage])
    v, s_v = quantize_kv(torch.randn(num_blocks, block_size, KV, D) * mag, STORAGE[storage])
    tables = torch.randperm(num_blocks)[: B * width].view(B, width).to(torch.int32)
    q = torch.randn(B, Tq, H, D) * 0.1
    to = lambda t: t.to(device)  # noqa: E731
    return to(q.to(dtype)), to(k), to(v), to(s_k), to(s_v), to(tables), to(torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_is_attention_over_the_dequantised_pools(storage, window):
    q, k, v, s_k, s_v, tables, lens = _inputs([3, 17, 40], 3, 4, 2, 8, 4, torch.float64, storage)
    got = paged_attention_quant_reference(q, k, v, s_k, s_v, tables, lens, window=window)
    kd = k.double() * s_k.double()[..., None]
    vd = v.double() * s_v.double()[..., None]
    want = paged_attention_per_sequence(q, kd, vd, tables, lens, window=window)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_reference_errors_name_the_fix():
    q, k, v, s_k, s_v, tables, lens = _inputs([5], 1, 2, 2, 8, 4, torch.float32, "int8")
    with pytest.raises(TypeError, match="int8 or float8_e4m3fn"):
        paged_attention_quant_reference(q, k.float(), v.float(), s_k, s_v, tables, lens)
    with pytest.raises(ValueError, match="k_scale.*kv_scales"):
        paged_attention_quant_reference(q, k, v, s_k[..., :1], s_v, tables, lens)


needs_triton = pytest.mark.skipif(not INTERPRETING and not torch.cuda.is_available(),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


def _fp8_ok() -> bool:
    return INTERPRETING or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0))


@needs_triton
@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("Tq,H,KV,lens,kw", [
    (1, 4, 4, [1, 16, 37], {}),                     # MHA, one new token
    (3, 8, 2, [3, 90, 41], {"num_splits": 3}),      # GQA, split-K, a few new tokens
    (2, 4, 1, [200, 5], {"window": 7}),             # MQA, sliding window
], ids=["mha", "gqa-split", "mqa-window"])
def test_triton_matches_the_float64_reference(storage, dtype, Tq, H, KV, lens, kw):
    if storage == "fp8" and not _fp8_ok():
        pytest.skip("float8 KV kernels need Hopper")
    q, k, v, s_k, s_v, tables, lens_t = _inputs(lens, Tq, H, KV, 64, 16, dtype, storage, device=TRITON_DEVICE)
    o = paged_attention_quant_triton(q, k, v, s_k, s_v, tables, lens_t, **kw)
    ref_kw = {key: val for key, val in kw.items() if key != "num_splits"}
    ref = paged_attention_quant_reference(q.double(), k, v, s_k, s_v, tables, lens_t, **ref_kw)
    assert o.shape == q.shape and o.dtype == dtype
    assert rel_err(o, ref) < TOL[dtype], (storage, dtype, Tq, H, KV, lens, kw)


@needs_triton
def test_triton_writes_every_output_element(poison):
    poison()  # output and split workspaces start as NaN
    q, k, v, s_k, s_v, tables, lens = _inputs([2, 70, 45], 2, 8, 2, 64, 8, torch.float16, "int8", device=TRITON_DEVICE)
    o = paged_attention_quant_triton(q, k, v, s_k, s_v, tables, lens, num_splits=4)
    ref = paged_attention_quant_reference(q.double(), k, v, s_k, s_v, tables, lens)
    assert rel_err(o, ref) < TOL[torch.float16]


def test_registry_picks_by_storage():
    """int8 takes the Triton kernel on any GPU the paged kernel runs on; fp8 only from compute capability 9.0."""
    from plyx.specs.kernels import KernelQuery

    def chosen(fp8: int, cc: tuple[int, int]) -> str:
        query = KernelQuery(device_type="cuda", dtype="bfloat16", compute_capability=cc,
                            shape={"head_dim": 128, "fp8": fp8})
        return next(c.impl.impl for c in registry().explain("paged_attention_quant", query) if c.taken)

    if chosen(0, (8, 0)) == "reference":  # no triton installed: every query takes the reference
        pytest.skip("triton is not installed")
    assert chosen(0, (8, 0)) == "triton"
    assert chosen(1, (8, 0)) == "reference"
    assert chosen(1, (9, 0)) == "triton_fp8"
    cpu = KernelQuery(device_type="cpu", dtype="float32", shape={"head_dim": 64, "fp8": 1})
    assert next(c.impl.impl for c in registry().explain("paged_attention_quant", cpu) if c.taken) == "reference"


@needs_triton
@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("v_trans", [0, 1], ids=["values-as-stored", "values-transposed"])
def test_both_value_layouts_match_the_float64_reference(storage, v_trans):
    """The launch config's value layout (``v_trans``: loaded [D, BN] and transposed, the quantised default, or
    [BN, D] as stored) changes how the tile reaches the tensor cores, never the result; split-K and GQA."""
    if storage == "fp8" and not _fp8_ok():
        pytest.skip("float8 KV kernels need Hopper")
    q, k, v, s_k, s_v, tables, lens = _inputs([3, 90, 41], 2, 8, 2, 64, 16, torch.bfloat16, storage,
                                              device=TRITON_DEVICE)
    o = paged_attention_quant_triton(q, k, v, s_k, s_v, tables, lens, num_splits=3, config={"v_trans": v_trans})
    ref = paged_attention_quant_reference(q.double(), k, v, s_k, s_v, tables, lens)
    assert rel_err(o, ref) < TOL[torch.bfloat16], (storage, v_trans)


def test_unknown_launch_config_key_names_the_keys():
    q, k, v, s_k, s_v, tables, lens = _inputs([5], 1, 4, 2, 64, 16, torch.bfloat16, "int8")
    with pytest.raises(ValueError, match=r"unknown launch config keys \['block_m'\].*block_n"):
        paged_attention_quant_triton(q, k, v, s_k, s_v, tables, lens, config={"block_m": 32})


#: compiles the quantised decode kernel for an H100 (sm_90) without a GPU, in a fresh interpreter (under
#: TRITON_INTERPRET=1 kernels cannot be compiled), with the launch's specialisation (pointers and the pools'
#: strides divisible by 16, as the cache's pools are) and its default tile; prints, per (pool, v_trans), the
#: PTX's byte-wide shared-memory loads, transposing ldmatrix and mma instructions
_SM90_SCRIPT = r"""
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from plyx.kernel.attention._paged import GPU_CONFIG_QUANT_SPLIT as C, _paged_fwd

params = list(inspect.signature(_paged_fwd.fn).parameters)
out = {}
for pool, v_trans in json.loads(sys.argv[1]):
    ptrs = {"Q": "*bf16", "K_POOL": pool, "V_POOL": pool, "K_SCALE": "*fp32", "V_SCALE": "*fp32",
            "BLOCK_TABLES": "*i32", "CONTEXT_LENS": "*i32", "OUT": "*bf16", "PART_ACC": "*fp32", "PART_ML": "*fp32"}
    const = dict(GROUP=8, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=C["block_n"], ROW_TILES=1, SPLIT=True,
                 HAS_WINDOW=False, USE_GDC=False, QUANT=True, V_T=bool(v_trans))
    aligned = set(ptrs) | {"stride_kblk", "stride_kslot", "stride_kh", "stride_vblk", "stride_vslot", "stride_vh",
                           "stride_ksblk", "stride_vsblk", "stride_bt_b"}
    sig = {p: "constexpr" if p in const else ptrs.get(p, "fp32" if p == "qk_scale" else "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in aligned}
    ptx = triton.compile(ASTSource(fn=_paged_fwd, signature=sig, constexprs=const, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=C["num_warps"], num_stages=C["num_stages"])).asm["ptx"]
    out[f"{pool}:{v_trans}"] = dict(byte_loads=len(re.findall(r"ld\.shared\.[bsu]8", ptx)),
                                    ldmatrix_trans=ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans"),
                                    mma=ptx.count("mma.sync"))
print(json.dumps(out))
"""


def test_sm90_kernel_reads_no_8bit_operand_byte_by_byte(tmp_path):
    """Compiled for sm_90 on the CPU: the tensor cores take 16-bit tiles (mma), the values reach them through
    ldmatrix.trans, and no shared-memory load moves a single byte. The 8-bit value tile loaded as stored and
    widened in the dot gave 64 ``ld.shared.b8`` per thread and 128-token tile (the B operand's token pairs
    gathered byte by byte); that layout's PTX is the control."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no NVIDIA backend to compile for sm_90")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    cases = [["*i8", 1], ["*fp8e4nv", 1], ["*i8", 0]]
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    for pool in ("*i8", "*fp8e4nv"):
        got = ptx[f"{pool}:1"]
        assert got["mma"] > 0 and got["ldmatrix_trans"] > 0 and got["byte_loads"] == 0, (pool, got)
    assert ptx["*i8:0"]["byte_loads"] >= 32, ptx  # the control: the layout is what removes them


#: aten ops that read a tensor's value on the host: a device sync, which CUDA-graph capture refuses
_HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal")


def _host_reads(fn) -> list[str]:
    """The host-value reads among the aten ops ``fn()`` dispatches (the CPU proxy of a graph-capturable call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return [op for op in rec.ops if op.startswith(_HOST_READS)]


@needs_triton
def test_quantised_decode_step_kernels_read_nothing_on_the_host():
    """Every kernel of a quantised cache's decode step (the fused RoPE + quantising store, the quantising store,
    the paged attention with split-K) launches without reading a tensor's value on the host, so the step
    captures into a CUDA graph; the reference store, which checks its slots on the host, is the control."""
    from plyx.kernel.reference.store_kv_quant import store_kv_quant as store_reference
    from plyx.kernel.triton_ops.rope_store_kv_quant import rope_store_kv_quant
    from plyx.kernel.triton_ops.store_kv_quant import store_kv_quant

    dev = TRITON_DEVICE
    q, k, v, s_k, s_v, tables, lens = _inputs([30, 70], 1, 8, 2, 64, 16, torch.bfloat16, "int8", device=dev)
    slots = torch.tensor([3, 40], device=dev)
    flat = (k.view(-1, 2, 64), v.view(-1, 2, 64), s_k.view(-1, 2), s_v.view(-1, 2))
    new = torch.randn(2, 2, 64, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(2, 1, 12, 64, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.ones(1, 32, device=dev), torch.zeros(1, 32, device=dev)
    assert _host_reads(lambda: paged_attention_quant_triton(q, k, v, s_k, s_v, tables, lens, num_splits=3)) == []
    assert _host_reads(lambda: store_kv_quant(new, new, *flat, slots)) == []
    assert _host_reads(lambda: rope_store_kv_quant(qkv, cos, sin, *flat, slots, n_heads=8, n_kv_heads=2)) == []
    assert _host_reads(lambda: store_reference(new, new, *flat, slots))  # the control: it syncs
