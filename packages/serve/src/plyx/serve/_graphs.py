"""``DecodeGraphs``: the one-token decode step as replayed CUDA graphs, one per batch-size bucket.

At batch 1 a ~1B model's step is ~200 kernel launches and as many Python dispatches;
on a GPU that host work, not the weights' memory traffic, sets the speed. Captured once
per bucket, a step becomes: reserve slots and fill one pinned buffer on the host, one
copy, one ``graph.replay()`` (vLLM's and SGLang's approach). The inputs live at fixed
addresses (``plyx.attn.StaticDecode``); batches are padded up to the next bucket.

A bucket is captured the first time a batch of its size runs: that step first runs
eagerly on a side stream (its result is the step's result, and the Triton kernels are
compiled and warm), then the same call is captured; later steps replay. All graphs
share one memory pool: they run one at a time on one stream.

Without CUDA (``capture=False``) the same static step runs eagerly: the path the CPU
tests check against the ordinary forward.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DecodeGraphs", "default_buckets"]


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32 (vLLM's spacing), ending at ``max_batch``."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 1, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """Runs one-token decode steps of ``model`` over ``cache`` through captured CUDA graphs.

    Args:
        model: a ``plyx.model.TransformerLM`` (anything taking ``position_ids=`` and ``kv_step=``).
        cache: a block-addressable KV cache (``plyx.attn.supports_static_decode``).
        max_batch: the most sequences of one step (the largest bucket).
        capture: capture graphs (needs CUDA); False runs the static step eagerly.

    ``step`` returns a view of a static output buffer: use it before the next ``step``.
    """

    def __init__(self, model: Any, cache: Any, *, max_batch: int, capture: bool = True,
                 buckets: Sequence[int] | None = None) -> None:
        from plyx.attn import StaticDecode

        device = torch.device(cache.layout.device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. Pass cuda_graphs=False")
        self.model = model
        pack = getattr(model, "pack_projections_", None)
        if pack is not None:  # one GEMV for q/k/v and one for gate/up per layer: same weights, restacked in place
            pack()
        self.capture = capture
        self.decode = StaticDecode(cache, max_batch=max_batch)
        self.buckets = sorted(set(buckets)) if buckets else default_buckets(max_batch)
        if self.buckets[-1] > max_batch or self.buckets[0] < 1:
            raise ValueError(f"buckets {self.buckets} must lie in [1, max_batch={max_batch}]")
        self.max_batch = self.buckets[-1]
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool: Any = None
        self.steps = 0  # every step run here
        self.replays = 0  # the steps that replayed a captured graph

    def bucket(self, batch: int) -> int | None:
        """The padded size a batch of ``batch`` rows runs with (None: larger than every bucket)."""
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    @torch.inference_mode()
    def step(self, seq_ids: Sequence[int], tokens: torch.Tensor | Sequence[int], *, greedy: bool = False) -> Any:
        """Feed each sequence its one new token (``[B]`` on device, or host ints); logits ``[B, V]`` (float32).

        ``greedy`` also returns each row's argmax token ``[B]``, computed inside the graph by the same
        fused kernel as the greedy sampler: plain greedy decoding then launches nothing from Python
        between two replays.
        """
        B = len(seq_ids)
        bucket = self.bucket(B)
        if bucket is None:
            raise ValueError(f"a decode step of {B} sequences exceeds the largest graph bucket ({self.max_batch})")
        self.decode.prepare(seq_ids, tokens, bucket)
        self.steps += 1
        if not self.capture:
            out = self._forward(bucket, greedy)
        elif (entry := self._graphs.get((bucket, greedy))) is None:
            out = self._capture(bucket, greedy)
        else:
            graph, out = entry
            graph.replay()
            self.replays += 1
        return (out[0][:B], out[1][:B]) if greedy else out[:B]

    def _forward(self, bucket: int, greedy: bool) -> Any:
        ids, positions, step = self.decode.inputs(bucket)
        logits = self.model(ids, position_ids=positions, kv_step=step)[:, -1]  # [bucket, V]
        if not greedy:
            return logits
        from plyx.serve._processors import GreedySampler

        return logits, GreedySampler()(logits, None)  # type: ignore[arg-type]  # greedy reads no state

    def _capture(self, bucket: int, greedy: bool) -> Any:
        # warm-up on a side stream (torch's rule for capture): this step's real result, kernels compiled
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = self._forward(bucket, greedy)
        torch.cuda.current_stream().wait_stream(side)
        for t in result if greedy else (result,):
            t.record_stream(torch.cuda.current_stream())  # allocated on the side stream, read on this one
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # capturing records the kernels without running them: the cache is not written twice
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(bucket, greedy)
        except RuntimeError as exc:  # a kernel that syncs with the host (a reference fallback) cannot be captured
            torch.cuda.synchronize()
            warnings.warn(
                f"CUDA graph capture of the decode step failed, so decode steps run eagerly from now on "
                f"(a kernel the registry chose syncs with the host; `plyx kernels explain paged_attention` "
                f"shows which): {str(exc).splitlines()[0]}", RuntimeWarning, stacklevel=3)
            self.capture = False
            return result
        self._graphs[(bucket, greedy)] = (graph, out)
        return result

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far (with or without the greedy token output)."""
        return sorted({bucket for bucket, _ in self._graphs})
