"""Triton grouped GEMM against the float64 per-expert loop: forward, input and weight gradients."""

from __future__ import annotations

import pytest
import torch
from plyx.kernel import KernelInputError
from plyx.kernel.reference import grouped_gemm as reference
from plyx.kernel.triton_ops.grouped_gemm import WgradTile, grouped_gemm

from .conftest import GPU, TRITON_DEVICE, rel_max_err

# (rows per expert, N, K): the interpreter's tiles are 16 x 32 x 32, so 17, 33 and 40 straddle them;
# empty experts (0 rows) first, in the middle and last; one expert with everything; more row tiles than GROUP_M
CASES = [((3, 0, 17, 5), 40, 24), ((0, 33, 1), 20, 48), ((9,), 33, 16), ((2, 2, 2, 2, 2, 0), 8, 8),
         ((17,) * 9 + (0, 3, 33), 8, 16)]  # 26 row tiles: several swizzle groups of 8, the last one partial
if GPU:
    CASES += [((700, 3, 0, 1300, 64), 1024, 2048), ((1,) * 64, 2048, 1024)]


def _inputs(make, counts, n, k, dtype):
    offsets = torch.tensor([0, *counts]).cumsum(0).to(TRITON_DEVICE)
    return make(sum(counts), k, dtype=dtype), make(len(counts), n, k, dtype=dtype, scale=k ** -0.5), offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_per_expert_loop(parity, make, case, dtype):
    counts, n, k = case
    parity(grouped_gemm, reference, _inputs(make, counts, n, k, dtype), grad=(0, 1), dtype=dtype,
           label=f"grouped_gemm rows {counts} N={n} K={k}")


def test_strided_operands_and_explicit_blocks(parity, make):
    counts = (4, 0, 9)
    x = make(24, sum(counts)).T  # (13, 24) with strides (1, 13)
    w = make(3, 24, 40).transpose(1, 2)  # (3, 40, 24) strided
    offsets = torch.tensor([0, *counts]).cumsum(0).to(TRITON_DEVICE)
    parity(lambda *a: grouped_gemm(*a, blocks=(16, 16, 16, 4, 1)), reference, [x, w, offsets], grad=(0, 1),
           label="strided")


#: every weight-gradient variant the sweep times, at the interpreter's tile (16 rows a step, dW tiles 32 x 32)
WGRAD_VARIANTS = [WgradTile(16, 32, 32, 4, 1, schedule, split, tma)
                  for schedule, split, tma in [("expert", 1, False), ("tile", 1, False), ("persistent", 1, False),
                                               ("expert", 3, False), ("persistent", 2, False), ("tile", 2, False),
                                               ("expert", 1, True), ("persistent", 2, True), ("tile", 1, True),
                                               ("persistent-flat", 1, False), ("persistent-flat", 1, True)]]
#: uneven routing with empty experts (first, middle, last), rows straddling the 16-row step and a split
#: (17 rows in 3 splits: 16 + 1 + nothing), dW tiles straddling N and K; N = 40 and K = 24 keep bf16 rows
#: 16-byte aligned, so the TMA variants take descriptors there (N = 20 does not: the pointer loads)
WGRAD_CASES = [((0, 3, 0, 17, 5, 0), 40, 24), ((33, 1, 0, 40), 20, 48)]
if GPU:  # compiled: the variants at the tiles the sweep times, on an uneven training-sized routing
    WGRAD_VARIANTS += [WgradTile(64, 128, 128, 8, 3, schedule, split, tma)  # float32 stages fit too
                       for schedule, split, tma in [("expert", 1, False), ("tile", 1, False), ("persistent", 1, True),
                                                    ("expert", 2, False), ("persistent-flat", 1, True)]]
    WGRAD_CASES += [((700, 3, 0, 1300, 64), 1024, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", WGRAD_CASES, ids=str)
@pytest.mark.parametrize("tile", WGRAD_VARIANTS, ids=lambda t: f"{t.schedule}-split{t.split}{'-tma' if t.tma else ''}")
def test_weight_grad_variants_match_the_per_expert_loop(parity, make, case, dtype, tile):
    counts, n, k = case
    blocks = {"forward": (16, 16, 16, 4, 1), "input_grad": (16, 32, 16, 4, 1), "weight_grad": tile}
    parity(lambda *a: grouped_gemm(*a, blocks=blocks), reference, _inputs(make, counts, n, k, dtype), grad=(0, 1),
           dtype=dtype, label=f"grouped_gemm {tile} rows {counts} N={n} K={k}")


#: rows straddling the 16-row tile, N = 40 and K = 40 straddling 32-wide tiles (a weight tile reaching into the
#: next expert's rows: past N it feeds unstored columns, past K it meets x's zero fill), empty experts
TMA_ROW_CASES = [((3, 0, 17, 5), 40, 24), ((0, 33, 1), 24, 40), ((2, 2, 2, 2, 2, 0), 8, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TMA_ROW_CASES, ids=str)
def test_tma_row_passes_match_the_per_expert_loop(parity, make, case, dtype):
    """Forward and input gradient with x and W through TMA descriptors (both weight layouts)."""
    from plyx.kernel.triton_ops.grouped_gemm import _w_tma

    counts, n, k = case
    args = _inputs(make, counts, n, k, dtype)
    x, w = args[0], args[1]
    assert _w_tma(x, w, (w.stride(0), w.stride(1), w.stride(2)), n, k) == 1  # forward: W contiguous in K
    assert _w_tma(x.new_zeros(1, n), w, (w.stride(0), w.stride(2), w.stride(1)), k, n) == 2  # input grad
    blocks = {"forward": (16, 32, 32, 4, 1, True), "input_grad": (16, 32, 32, 4, 1, True),
              "weight_grad": WgradTile(16, 32, 32, 4, 1)}
    parity(lambda *a: grouped_gemm(*a, blocks=blocks), reference, args, grad=(0, 1), dtype=dtype,
           label=f"grouped_gemm tma rows {counts} N={n} K={k}")


def test_tma_takes_descriptors_only_where_the_strides_allow():
    from plyx.kernel.triton_ops.grouped_gemm import _tma_ok

    x = torch.zeros(8, 24, dtype=torch.bfloat16, device=TRITON_DEVICE)
    assert _tma_ok(x, torch.zeros(8, 40, dtype=torch.bfloat16, device=TRITON_DEVICE))
    assert not _tma_ok(x, torch.zeros(8, 20, dtype=torch.bfloat16, device=TRITON_DEVICE))  # 40-byte rows
    assert not _tma_ok(x, torch.zeros(40, 8, dtype=torch.bfloat16, device=TRITON_DEVICE).T)  # inner stride 8
    from plyx.kernel.triton_ops.grouped_gemm import _w_tma

    w = torch.zeros(3, 40, 24, dtype=torch.bfloat16, device=TRITON_DEVICE)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # (3, 40, 24) contiguous in N
    assert _w_tma(x, w, (w.stride(0), w.stride(1), w.stride(2)), 40, 24) == 1
    assert _w_tma(x, wt, (wt.stride(0), wt.stride(1), wt.stride(2)), 40, 24) == 2  # stored transposed
    ws = w[:, :, :16]  # a K slice (3, 40, 16): rows still 24 apart, the experts still one [E * N, K] matrix
    assert _w_tma(x[:, :16], ws, (ws.stride(0), ws.stride(1), ws.stride(2)), 40, 16) == 1
    wn = w[:, :32]  # (3, 32, 24): expert stride 40 * 24 != 32 * 24
    assert _w_tma(x, wn, (wn.stride(0), wn.stride(1), wn.stride(2)), 32, 24) == 0


def test_weight_grad_of_no_rows_is_zero_for_every_variant(make):
    """M = 0 (nothing routed): dW is zeros of the weight's dtype, never the allocator's garbage."""
    from plyx.kernel.triton_ops._common import poisoned

    w = make(3, 40, 24).requires_grad_()
    for tile in WGRAD_VARIANTS:
        with poisoned():
            y = grouped_gemm(make(0, 24).requires_grad_(), w, torch.zeros(4, dtype=torch.int64, device=TRITON_DEVICE),
                             blocks={"weight_grad": tile})
            (dw,) = torch.autograd.grad(y.sum() + 0 * w.sum(), [w])
        assert dw.dtype == w.dtype and torch.equal(dw, torch.zeros_like(dw)), tile


def test_bad_blocks_name_the_choices(make):
    x, w, offsets = make(5, 8), make(2, 4, 8).requires_grad_(), torch.tensor([0, 2, 5], device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"unknown passes \['wgrad'\]"):
        grouped_gemm(x, w, offsets, blocks={"wgrad": (16, 16, 16, 4, 1)})
    y = grouped_gemm(x, w, offsets, blocks={"weight_grad": WgradTile(16, 32, 32, 4, 1, "zigzag")})
    with pytest.raises(ValueError, match=r"schedule 'zigzag' is not one of \('expert', 'tile', 'persistent', 'persistent-flat'\)"):
        y.sum().backward()


def test_bad_inputs_name_kernel_and_argument():
    x = torch.randn(5, 8, device=TRITON_DEVICE)
    w = torch.randn(2, 4, 8, device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"grouped_gemm:triton.*`weight`.*\[E, N, K=8\]"):
        grouped_gemm(x, w[:, :, :7], torch.tensor([0, 2, 5], device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"`offsets`.*\[E \+ 1 = 3\]"):
        grouped_gemm(x, w, torch.tensor([0, 5], device=TRITON_DEVICE))
    with pytest.raises(KernelInputError, match=r"grouped_gemm:reference.*`offsets`.*rise from 0 to M=5"):
        reference(x, w, torch.tensor([0, 4, 3], device=TRITON_DEVICE))


def _moe_mlp(permute, gemm, unpermute):
    """The experts' SwiGLU MLP as SparseMoE composes it, from the given implementations of the three kernels."""
    def run(x, gate_up, down, ids, weights):
        xs, positions, offsets = permute(x, ids, num_experts=gate_up.shape[0])
        h = gemm(xs, gate_up, offsets)
        f = down.shape[2]
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]  # strided halves, as in the model
        return unpermute(gemm(a, down, offsets), positions, weights)
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_three_kernels_composed_as_an_moe_mlp(parity, make, dtype):
    """permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> weighted unpermute, gradients of all five inputs."""
    from plyx.kernel.reference import moe_permute as ref_permute
    from plyx.kernel.reference import moe_unpermute as ref_unpermute
    from plyx.kernel.triton_ops.moe_permute import moe_permute
    from plyx.kernel.triton_ops.moe_unpermute import moe_unpermute

    t, d, f, e, k = 19, 24, 40, 5, 2
    ids = torch.rand(t, e).argsort(-1)[:, :k].to(TRITON_DEVICE)
    args = [make(t, d, dtype=dtype), make(e, 2 * f, d, dtype=dtype, scale=d ** -0.5),
            make(e, d, f, dtype=dtype, scale=f ** -0.5), ids, torch.rand(t, k).to(TRITON_DEVICE, dtype)]
    # bf16: the composition rounds three times (first GEMM, SwiGLU, second GEMM) where the float64 reference never
    # does, so its error is up to ~3 single-kernel roundings (2.2e-2 seen against the single-kernel 2e-2 bound)
    tolerances = (3e-2, 6e-2) if dtype == torch.bfloat16 else None
    parity(_moe_mlp(moe_permute, grouped_gemm, moe_unpermute), _moe_mlp(ref_permute, reference, ref_unpermute), args,
           grad=(0, 1, 2, 4), dtype=dtype, label="moe mlp", tolerances=tolerances)


def test_pick_blocks_takes_the_big_tile_only_where_its_stages_fit(monkeypatch):
    """Many rows per expert take 128x256x64 with 4 stages (192 KiB of shared memory) on an H100 (227 KiB
    opt-in) and keep 128x128 on an A100 (163 KiB), where the big tile would fail to launch."""
    from plyx.kernel.triton_ops import grouped_gemm as gg

    monkeypatch.setattr(gg, "interpreting", lambda: False)
    monkeypatch.setattr(gg, "_shared_memory", lambda device: 232_448)
    assert gg.pick_blocks(32768, 64) == (128, 256, 64, 8, 4)
    assert gg.pick_blocks(64 * 8, 64) == (16, 64, 64, 4, 3)  # decode: a few rows per expert
    assert gg.pick_blocks(32768, 64, itemsize=4) == (128, 128, 64, 8, 3)  # float32 stages need 288 KiB
    monkeypatch.setattr(gg, "_shared_memory", lambda device: 167_936)
    assert gg.pick_blocks(32768, 64) == (128, 128, 64, 8, 3)
    bm, bn, bk, _, stages = gg.pick_blocks(32768, 64)
    assert gg._stage_bytes(bm, bn, bk) * stages <= 167_936


def test_pick_takes_the_measured_table_per_pass(monkeypatch):
    """A device's entry of grouped_gemm_tiles.json decides each pass for many rows per expert (16-bit inputs,
    stages that fit); a float32 call, a decode-sized call or an entry whose stages do not fit keep the built-ins."""
    from plyx.kernel.triton_ops import grouped_gemm as gg

    monkeypatch.setattr(gg, "interpreting", lambda: False)
    monkeypatch.setattr(gg, "_shared_memory", lambda device: 232_448)
    table = {"forward": [128, 128, 64, 4, 3], "input_grad": [64, 256, 64, 8, 4],
             "weight_grad": [64, 128, 256, 8, 4, "persistent", 1, True]}
    monkeypatch.setattr(gg, "_tuned", lambda device: table)
    assert gg.pick_blocks(32768, 64, pass_="forward") == (128, 128, 64, 4, 3)
    assert gg.pick_blocks(32768, 64, pass_="input_grad") == (64, 256, 64, 8, 4)
    assert gg.pick_weight_grad(32768, 64) == WgradTile(64, 128, 256, 8, 4, "persistent", 1, True)
    assert gg.pick_blocks(32768, 64, itemsize=4, pass_="forward") == (128, 128, 64, 8, 3)
    assert gg.pick_weight_grad(32768, 64, itemsize=4) == WgradTile(64, 128, 64, 8, 3)
    assert gg.pick_weight_grad(64 * 8, 64) == WgradTile(16, 64, 64, 4, 3)  # decode: the small tile
    table["weight_grad"] = [64, 256, 256, 8, 4, "expert", 1, False]  # 256 KiB of stages
    assert gg.pick_weight_grad(32768, 64) == WgradTile(64, 128, 64, 4, 3)  # the forward's tile, expert-major


def test_the_shipped_table_holds_valid_tiles():
    """Every entry the sweep wrote names known passes, 5-int tiles for the row passes and a WgradTile."""
    import json

    from plyx.kernel.triton_ops import grouped_gemm as gg

    table = json.loads(gg.TABLE.read_text())
    assert table, "grouped_gemm_tiles.json is empty"
    for device, entry in table.items():
        assert set(entry["passes"]) <= set(gg.PASSES), device
        for pass_, tile in entry["passes"].items():
            if pass_ == "weight_grad":
                wt = WgradTile(*tile)
                assert wt.schedule in gg.SCHEDULES and wt.split >= 1 and isinstance(wt.tma, bool), (device, tile)
            else:
                assert len(tile) == 5 or (len(tile) == 6 and isinstance(tile[5], bool)), (device, pass_, tile)
            assert all(isinstance(v, int) and v > 0 for v in tile[:5]), (device, pass_, tile)



# ---- the fused options: rows gathered through the routing's index, the SwiGLU in the epilogue ----------

#: (tokens, K, F, experts, top-k): F = 20 and 40 straddle the interpreter's 32-wide N tiles, K = 24 / 48 its
#: 32-deep K steps; 3 experts of top-3 route every token everywhere, 1 token of top-1 leaves 3 of 4 empty
FUSED_CASES = [(13, 24, 20, 5, 2), (7, 48, 40, 3, 3), (1, 8, 16, 4, 1)]
if GPU:
    FUSED_CASES += [(1024, 2048, 1024, 64, 8), (37, 256, 96, 16, 4)]


def _routing(t, e, k):
    from plyx.kernel.reference.moe_permute import routing_positions

    ids = torch.rand(t, e).argsort(-1)[:, :k].to(TRITON_DEVICE)  # k distinct experts per token
    return routing_positions(ids, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["swiglu", None], ids=str)
@pytest.mark.parametrize("case", FUSED_CASES, ids=str)
def test_gathered_rows_and_swiglu_match_the_loop(parity, make, case, activation, dtype):
    """x read through positions (no permuted copy), optionally silu(gate) * up in the epilogue: output, dx
    (each token's copies summed) and dW against the float64 loop over index_select'ed rows."""
    t, k_dim, f, e, top = case
    positions, offsets = _routing(t, e, top)
    n = 2 * f if activation else f
    args = [make(t, k_dim, dtype=dtype), make(e, n, k_dim, dtype=dtype, scale=k_dim ** -0.5), offsets]

    def fused(x, w, offs):
        return grouped_gemm(x, w, offs, gather=positions, activation=activation)

    def loop(x, w, offs):
        return reference(x, w, offs, gather=positions, activation=activation)

    parity(fused, loop, args, grad=(0, 1), dtype=dtype, label=f"grouped_gemm gather {activation} {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_without_gather_and_with_explicit_tiles(parity, make, dtype):
    """The epilogue alone (rows already grouped), and the gathered weight gradient under a split and a
    persistent schedule (the TMA request falls back to pointer loads for gathered rows)."""
    counts, f, k_dim = (3, 0, 17, 5), 40, 24
    args = list(_inputs(make, counts, 2 * f, k_dim, dtype))
    parity(lambda *a: grouped_gemm(*a, activation="swiglu"), lambda *a: reference(*a, activation="swiglu"), args,
           grad=(0, 1), dtype=dtype, label="swiglu epilogue")
    # no gradient wanted (inference): the epilogue skips storing the halves, the activation is the same
    parity(lambda *a: grouped_gemm(*a, activation="swiglu"), lambda *a: reference(*a, activation="swiglu"), args,
           dtype=dtype, label="swiglu epilogue, inference")
    positions, offsets = _routing(11, 4, 2)
    for tile in (WgradTile(16, 32, 32, 4, 1, "expert", 3, False), WgradTile(16, 32, 32, 4, 1, "persistent", 1, True)):
        blocks = {"forward": (16, 16, 32, 4, 1, True), "input_grad": (16, 32, 16, 4, 1), "weight_grad": tile}
        parity(lambda x, w, o, blocks=blocks: grouped_gemm(x, w, o, gather=positions, activation="swiglu", blocks=blocks),
               lambda x, w, o: reference(x, w, o, gather=positions, activation="swiglu"),
               [make(11, k_dim, dtype=dtype), make(4, 2 * f, k_dim, dtype=dtype, scale=k_dim ** -0.5), offsets],
               grad=(0, 1), dtype=dtype, label=f"gathered swiglu {tile}")


def test_tile_table_numbers_each_experts_row_tiles():
    """One launch builds what the torch ops did: tile i's expert (E for the spare tiles) and first row."""
    from plyx.kernel.triton_ops.grouped_gemm import _tiles

    for counts, bm in (((2, 2, 8, 10, 4), 4), ((0, 33, 0, 1, 0), 16), ((0,) * 5, 16), ((5,), 8), ((1,) * 70, 16)):
        offsets = torch.tensor([0, *counts]).cumsum(0).to(TRITON_DEVICE)
        tile_e, tile_row, grid_m = _tiles(offsets, bm, sum(counts))
        want_e, want_row = [], []
        for e, (lo, c) in enumerate(zip(offsets.tolist(), counts)):
            for i in range(-(-c // bm)):
                want_e.append(e)
                want_row.append(lo + i * bm)
        assert grid_m == -(-sum(counts) // bm) + len(counts)
        assert tile_e.tolist()[:len(want_e)] == want_e, counts
        assert tile_row.tolist()[:len(want_row)] == want_row, counts
        assert set(tile_e.tolist()[len(want_e):]) <= {len(counts)}  # spare tiles: nothing to do


def test_source_rows_and_swiglu_grad(make):
    from plyx.kernel.reference import swiglu as ref_swiglu
    from plyx.kernel.triton_ops.grouped_gemm import source_rows, swiglu_grad

    positions, _ = _routing(37, 6, 3)
    rows = source_rows(positions)
    assert rows.dtype == torch.int32
    assert torch.equal(rows[positions.reshape(-1)].cpu().long(), torch.arange(37).repeat_interleave(3))
    h, da = make(50, 2 * 36, dtype=torch.float64), make(50, 36, dtype=torch.float64)
    h64 = h.clone().requires_grad_()
    (dh_want,) = torch.autograd.grad(ref_swiglu(h64[:, :36], h64[:, 36:]), [h64], da)
    assert rel_max_err(swiglu_grad(da.float(), h.float()), dh_want) < 1e-5


def test_fused_options_refuse_bad_input(make):
    x, w, offsets = make(5, 8), make(2, 6, 8), torch.tensor([0, 2, 5], device=TRITON_DEVICE)
    with pytest.raises(KernelInputError, match=r"grouped_gemm:triton.*`activation`.*'gelu' is not supported.*"
                                               r"\('swiglu',\)"):
        grouped_gemm(x, w, offsets, activation="gelu")
    with pytest.raises(KernelInputError, match=r"`weight`.*odd N=5"):
        grouped_gemm(x, make(2, 5, 8), offsets, activation="swiglu")
    with pytest.raises(KernelInputError, match=r"`gather`.*\[T=5, k\].*moe_permute's positions"):
        grouped_gemm(x, w, offsets, gather=torch.zeros(4, 2, dtype=torch.int64, device=TRITON_DEVICE))


def _fused_moe_mlp(gemm):
    """SparseMoE's composition since plyx-kernel 1.6: gathered rows and the SwiGLU inside the first GEMM, the
    combine with the gate weights in the second."""
    from plyx.kernel.reference.moe_permute import routing_positions

    def run(x, gate_up, down, ids, weights):
        positions, offsets = routing_positions(ids, gate_up.shape[0])
        a = gemm(x, gate_up, offsets, gather=positions, activation="swiglu")
        return gemm(a, down, offsets, combine=(positions, weights))
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_moe_mlp_matches_the_unfused_loop(parity, make, dtype):
    """The fused Triton MLP against the references composed without any fusion (permute copy, loop, SwiGLU,
    loop, unpermute): gradients of x, both expert weights and the gate weights."""
    from plyx.kernel.reference import moe_permute as ref_permute
    from plyx.kernel.reference import moe_unpermute as ref_unpermute

    t, d, f, e, k = 19, 24, 40, 5, 2
    ids = torch.rand(t, e).argsort(-1)[:, :k].to(TRITON_DEVICE)
    args = [make(t, d, dtype=dtype), make(e, 2 * f, d, dtype=dtype, scale=d ** -0.5),
            make(e, d, f, dtype=dtype, scale=f ** -0.5), ids, torch.rand(t, k).to(TRITON_DEVICE, dtype)]
    parity(_fused_moe_mlp(grouped_gemm), _moe_mlp(ref_permute, reference, ref_unpermute), args,
           grad=(0, 1, 2, 4), dtype=dtype, label="fused moe mlp")


#: (tokens, K, N, experts, top-k): N = 40 straddles the interpreter's 32-wide tiles (two partial sums per row)
COMBINE_CASES = [(13, 20, 24, 5, 2), (7, 48, 40, 3, 3), (1, 8, 16, 4, 1)]
if GPU:
    COMBINE_CASES += [(1024, 1024, 2048, 64, 8), (37, 96, 256, 16, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", COMBINE_CASES, ids=str)
def test_combine_matches_the_loop_and_unpermute(parity, make, case, dtype):
    """out[t] = sum_j w[t, j] * y[positions[t, j]]: output and the gradients of the rows, the weight and the gate
    weights (the backward reads dout through the routing; y is never saved)."""
    t, k_dim, n, e, top = case
    positions, offsets = _routing(t, e, top)
    args = [make(t * top, k_dim, dtype=dtype), make(e, n, k_dim, dtype=dtype, scale=k_dim ** -0.5), offsets,
            torch.rand(t, top).to(TRITON_DEVICE, dtype)]
    parity(lambda x, w, o, g: grouped_gemm(x, w, o, combine=(positions, g)),
           lambda x, w, o, g: reference(x, w, o, combine=(positions, g)), args, grad=(0, 1, 3), dtype=dtype,
           label=f"grouped_gemm combine {case}")


def test_combine_with_explicit_tiles_and_weight_grad_variants(parity, make):
    positions, offsets = _routing(17, 6, 2)
    for tile in (WgradTile(16, 32, 32, 4, 1, "expert", 2, False), WgradTile(16, 32, 32, 4, 1, "persistent", 1, True)):
        blocks = {"forward": (16, 32, 16, 4, 1), "input_grad": (16, 16, 32, 4, 1, True), "weight_grad": tile}
        parity(lambda x, w, o, g, blocks=blocks: grouped_gemm(x, w, o, combine=(positions, g), blocks=blocks),
               lambda x, w, o, g: reference(x, w, o, combine=(positions, g)),
               [make(34, 40), make(6, 24, 40, scale=40 ** -0.5), offsets, torch.rand(17, 2).to(TRITON_DEVICE)],
               grad=(0, 1, 3), label=f"combine {tile}")


def test_combine_refuses_bad_input(make):
    positions, offsets = _routing(5, 3, 2)
    x, w, g = make(10, 8), make(3, 6, 8), make(5, 2)
    with pytest.raises(KernelInputError, match=r"grouped_gemm:triton.*`combine`.*together with gather"):
        grouped_gemm(make(5, 8), make(3, 12, 8), offsets, gather=positions, activation="swiglu", combine=(positions, g))
    with pytest.raises(KernelInputError, match=r"`weights`.*differs from positions'"):
        grouped_gemm(x, w, offsets, combine=(positions, make(5, 3)))
    with pytest.raises(KernelInputError, match=r"`combine`.*expected \(positions, weights\)"):
        grouped_gemm(x, w, offsets, combine=positions)


def test_weight_gradients_on_copied_rows_match_too(parity, make, monkeypatch):
    """GATHER_WEIGHT_GRAD off (the benchmark's comparison): both weight gradients on materialised rows."""
    from plyx.kernel.reference import moe_permute as ref_permute
    from plyx.kernel.reference import moe_unpermute as ref_unpermute
    from plyx.kernel.triton_ops import grouped_gemm as gg

    monkeypatch.setattr(gg, "GATHER_WEIGHT_GRAD", False)  # as PLYX_MOE_GATHER_WGRAD=0 starts it
    t, d, f, e, k = 11, 24, 40, 4, 2
    ids = torch.rand(t, e).argsort(-1)[:, :k].to(TRITON_DEVICE)
    args = [make(t, d), make(e, 2 * f, d, scale=d ** -0.5), make(e, d, f, scale=f ** -0.5), ids,
            torch.rand(t, k).to(TRITON_DEVICE)]
    parity(_fused_moe_mlp(grouped_gemm), _moe_mlp(ref_permute, reference, ref_unpermute), args, grad=(0, 1, 2, 4),
           label="fused moe mlp, copied rows for the weight gradients")


def test_fused_passes_take_their_own_measured_tiles(monkeypatch):
    """A device entry for forward_swiglu / input_grad_combine decides those passes (training-sized, 16-bit, stages
    that fit: the SwiGLU's hold two weight tiles); otherwise None, and the caller halves a 256-wide tile."""
    from plyx.kernel.triton_ops import grouped_gemm as gg

    monkeypatch.setattr(gg, "interpreting", lambda: False)
    monkeypatch.setattr(gg, "_shared_memory", lambda device: 232_448)
    table = {"forward_swiglu": [128, 128, 64, 8, 4], "input_grad_combine": [64, 256, 64, 8, 3]}
    monkeypatch.setattr(gg, "_tuned", lambda device: table)
    assert gg.pick_fused("forward_swiglu", 32768, 64) == (128, 128, 64, 8, 4)  # (8 + 2 x 8) Ki elements x 2 B x 4 stages = 192 KiB
    assert gg.pick_fused("input_grad_combine", 32768, 64) == (64, 256, 64, 8, 3)
    assert gg.pick_fused("forward_swiglu", 64 * 8, 64) is None  # decode sizes keep the small tiles
    assert gg.pick_fused("forward_swiglu", 32768, 64, itemsize=4) is None
    table["forward_swiglu"] = [128, 256, 64, 8, 4]  # (8 + 2 x 16) Ki elements x 2 B x 4 = 320 KiB: no fit
    assert gg.pick_fused("forward_swiglu", 32768, 64) is None
    monkeypatch.setattr(gg, "_tuned", lambda device: {})
    assert gg.pick_fused("input_grad_combine", 32768, 64) is None
    with pytest.raises(ValueError, match=r"fused pass 'forward' is not one of"):
        gg.pick_fused("forward", 32768, 64)


def test_fused_options_without_grad_match(parity, make):
    """Serving: no input wants a gradient (the SwiGLU halves are not stored, the combine keeps no backward state)."""
    positions, offsets = _routing(9, 4, 2)
    parity(lambda x, w, o: grouped_gemm(x, w, o, gather=positions, activation="swiglu"),
           lambda x, w, o: reference(x, w, o, gather=positions, activation="swiglu"),
           [make(9, 24), make(4, 80, 24, scale=24 ** -0.5), offsets], label="gathered swiglu, no grad")
    g = torch.rand(9, 2).to(TRITON_DEVICE)
    parity(lambda x, w, o: grouped_gemm(x, w, o, combine=(positions, g)),
           lambda x, w, o: reference(x, w, o, combine=(positions, g.double())),
           [make(18, 40), make(4, 24, 40, scale=40 ** -0.5), offsets], label="combine, no grad")
