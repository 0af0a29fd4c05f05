"""The flash kernel's launch-config switches (TMA loads, persistent grid, single-pass atomic dQ, the scale folded
into the exponent) against the float64 reference, and the table that selects them.

In Triton's interpreter the tiles are 16 x 16 whatever the variant, so these cases exercise the switches'
code paths (descriptor loads and stores clipped at T and S, the persistent tile walk, the float32 atomic dQ
sums) at lengths that are not multiples of the tiles; ``warp_specialize`` only changes how a GPU schedules
the same loop (the interpreter runs it plainly). ``test_flash_sm90.py`` compiles them for an H100.
"""

from __future__ import annotations

import pytest
import torch
from plyx.kernel.attention import _flash as fl

from .conftest import INTERPRETING, TRITON_DEVICE
from .test_flash_attention import _check

pytestmark = pytest.mark.skipif(
    not INTERPRETING and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)

#: one variant per distinct set of switches the interpreter runs; on a GPU also those that differ only in tiles
#: and warp specialisation (the interpreter runs 16 x 16 tiles and plain loops whatever the variant)
SWITCHED = ["tma", "tma-persistent", "atomic-dq", "tma-atomic-dq", "tma-fold"] + (
    [] if INTERPRETING else ["dq-w8", "tma-ws", "bn128", "tma-bn128", "stages4", "tma-stages4", "tma-bn128-s3", "fold",
          "tma-bn128-s3-fold"]
)


@pytest.mark.parametrize("variant", SWITCHED)
@pytest.mark.parametrize(
    "case",
    [
        dict(B=2, T=37, S=37, H=4, KV=2, D=64, causal=True),  # GQA, causal, T not a multiple of the tiles
        dict(B=1, T=33, S=33, H=4, KV=1, D=128, causal=False, dtype=torch.bfloat16),  # MQA, full, Dh 128
        dict(B=2, T=20, S=45, H=2, KV=2, D=64, causal=True),  # queries are the last T positions
        dict(B=1, T=40, S=40, H=2, KV=1, D=64, causal=True, window=7),  # sliding window
    ],
    ids=["gqa-causal", "mqa-full-d128", "t-lt-s", "window"],
)
def test_variant_matches_reference(seed, variant, case):
    case = dict(case)
    shape = [case.pop(k) for k in ("B", "T", "S", "H", "KV", "D")]
    dtype = case.pop("dtype", torch.float16)
    with fl.use_config(variant):
        _check(seed, *shape, dtype, **case)


@pytest.mark.parametrize("variant", ["tma-persistent", "tma-atomic-dq", "tma-fold"])
def test_variant_packed_documents(seed, variant):
    T = 41
    docs = torch.sort(torch.randint(0, 6, (2, T)), dim=1).values
    docs[0, :3] = torch.tensor([-5, -4, -3])  # documents of one token
    with fl.use_config(variant):
        _check(seed, 2, T, T, 4, 2, 64, causal=True, document_ids=docs.to(TRITON_DEVICE))


def test_variant_writes_every_output_element(seed, poison):
    poison()  # outputs and workspaces start as NaN: the clipped TMA stores must still cover every row
    with fl.use_config("tma-persistent"):
        _check(seed, 2, 29, 29, 4, 2, 64, causal=True)
    with fl.use_config("tma-atomic-dq"):
        _check(seed, 1, 7, 50, 2, 2, 64, causal=False)


def test_tma_falls_back_to_pointer_loads_when_unaligned():
    x = torch.randn(2 * 3 * 2 * 64 + 1, device=TRITON_DEVICE, dtype=torch.float16)
    aligned = x[:-1].view(2, 3, 2, 64)
    shifted = x[1:].view(2, 3, 2, 64)  # base 2 bytes past a 16-byte boundary: no descriptor can start there
    cfg = fl.VARIANTS["tma"]
    assert fl._switches(cfg, aligned, aligned)["TMA"] is True
    assert fl._switches(cfg, aligned, shifted)["TMA"] is False
    assert fl._switches(fl.VARIANTS["baseline"], aligned)["TMA"] is False
    # and the fallback still computes the right thing
    q, k, v = (x[1:].view(2, 3, 2, 64).clone()[..., :] for _ in range(3))
    with fl.use_config("tma"):
        o = fl.flash_attention(shifted, shifted, shifted, causal=True)
    ref = fl.flash_attention(q, k, v, causal=True)
    assert torch.allclose(o.float(), ref.float(), atol=2e-3)


def test_best_table_names_variants_and_use_config_overrides_it(monkeypatch):
    for (d, causal), (fwd, bwd) in fl.BEST.items():
        assert d in fl.SUPPORTED_HEAD_DIMS and isinstance(causal, bool)
        assert fwd in fl.VARIANTS and bwd in fl.VARIANTS
    monkeypatch.setitem(fl.BEST, (128, True), ("tma", "atomic-dq"))
    assert fl.config_for(128, True, "fwd") == fl.VARIANTS["tma"]
    assert fl.config_for(128, True, "bwd") == fl.VARIANTS["atomic-dq"]
    assert fl.config_for(32, True, "fwd") == fl.VARIANTS["baseline"]  # no entry: the plain kernel
    with fl.use_config("tma-persistent") as cfg:
        assert cfg.persistent and cfg.tma
        assert fl.config_for(128, True, "bwd") is cfg
    assert fl.config_for(128, True, "bwd") == fl.VARIANTS["atomic-dq"]  # restored on exit
    with pytest.raises(KeyError, match="no variant 'fast'.*baseline"):
        with fl.use_config("fast"):
            pass


def test_best_table_entry_drives_the_kernels(seed, monkeypatch):
    # BEST's entry reaches the launches (forward and backward from different variants), and the result holds
    monkeypatch.setitem(fl.BEST, (64, True), ("tma-persistent", "tma-atomic-dq"))
    launched = []
    real = fl._launch

    def spy(kernel, tuned, tile, grid_of, args, meta):
        launched.append((kernel, meta))
        return real(kernel, tuned, tile, grid_of, args, meta)

    monkeypatch.setattr(fl, "_launch", spy)
    _check(seed, 1, 26, 26, 2, 1, 64, causal=True)
    kernels = [k for k, _ in launched]
    assert kernels == [fl._attn_fwd, fl._attn_bwd_dkdv]  # no dQ kernel: dQ came from the atomic pass
    (_, fwd), (_, dkdv) = launched
    assert fwd["PERSISTENT"] and fwd["TMA"] and dkdv["ATOMIC_DQ"] and dkdv["TMA"]
