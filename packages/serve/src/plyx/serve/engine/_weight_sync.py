"""``sync_weights``: copy a trained model's parameters into a running ``Engine`` in place, without a reload.

Online RL (plyx-rl's GRPO) samples with the engine and trains another copy of the model (float32 master
weights, autograd, an optimizer) in the same process. After each update the engine's weights must be the
policy's again. Copying tensor by tensor into the engine model's existing storage (``copy_``, with a cast
to the engine's dtype) keeps every pointer the engine holds valid: packed q/k/v buffers stay views of the
same parameters and captured CUDA graphs replay on the new values. What cannot stay valid is KV computed
by the old weights: the prefix cache is cleared, which is why a sync needs an idle engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["sync_weights"]


@torch.no_grad()
def sync_weights(engine: Any, source: torch.nn.Module) -> float:
    """Copy ``source``'s parameters and buffers into ``engine.model`` in place; returns the seconds taken.

    Args:
        engine: an idle ``plyx.serve.engine.Engine`` (no unfinished request).
        source: a module with the same parameter names and shapes (e.g. the policy being trained; it may keep
            another dtype or device: values are cast to the engine's).

    Returns:
        Wall seconds of the copy and the prefix-cache reset (device work included: it synchronises).

    Raises:
        RuntimeError: the engine has unfinished requests (their KV would mix old and new weights).
        ValueError: a parameter is missing on either side or has another shape (names the first few).
    """
    if engine.has_unfinished():
        raise RuntimeError("sync_weights needs an idle engine: finish or abort its requests first (their cached "
                           "keys and values were computed with the old weights)")
    t0 = time.perf_counter()
    target = engine.model
    if target is not source:
        dst = dict(target.named_parameters())
        dst.update(dict(target.named_buffers()))
        src = dict(source.named_parameters())
        src.update({k: v for k, v in source.named_buffers() if k in dst})
        missing = sorted(set(dst) - set(src))
        extra = sorted(set(src) - set(dst))
        if missing or extra:
            raise ValueError(f"sync_weights: parameter names differ (missing in source: {missing[:4]}, unknown to "
                             f"the engine: {extra[:4]}); sync a model of the same architecture")
        bad = [k for k in dst if dst[k].shape != src[k].shape]
        if bad:
            raise ValueError(f"sync_weights: shapes differ for {bad[:4]} (engine {list(dst[bad[0]].shape)} vs "
                             f"source {list(src[bad[0]].shape)}); sync a model of the same configuration")
        seen: set[int] = set()
        for name, t in dst.items():
            key = t.data_ptr()
            if key in seen:  # tied weights (embeddings / LM head): one storage, copy once
                continue
            seen.add(key)
            t.copy_(src[name].detach(), non_blocking=True)
    if engine.prefix is not None:
        engine.prefix.clear()  # blocks computed with the old weights must not be reused
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0
