"""Triton device helpers the decode-sized kernels share: weight tiles and the programmatic-dependent-launch wait."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["weight_tile", "wait_for_inputs"]


@triton.jit
def weight_tile(w_rows, k0, K, nmask, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` tile of the weight rows ``w_rows`` (pointers to each row's start) at columns
    ``k0 ...``, zero past K or past the rows' mask; with its column ids and column mask: ``(w, rk, kmask)``."""
    rk = k0 + tl.arange(0, BLOCK_K)
    kmask = rk < K
    return tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0), rk, kmask


@triton.jit
def wait_for_inputs(USE_GDC: tl.constexpr):
    """Under programmatic dependent launch (``USE_GDC``, see ``_common.pdl``): wait until the previous kernel's
    writes are visible, then let the next kernel launch. Before this, a kernel reads only what no kernel of
    the step writes (weights); without the launch attribute the wait returns at once."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
