"""``SpecGraphs``: the engine's greedy verification step (and the heads' next proposal) as replayed CUDA graphs.

Run eagerly, a speculating engine step is the packed forward plus ~20 host syncs and small launches per row
(acceptance per row in Python, the heads' forward, ``move_tokens``, ``crop``): on an H100 that host work, not
the k + 1 tokens per row, made chain verification 0.2x and tree verification 0.02x of plain graph decoding.

Here a decode-only step whose rows are all plain greedy runs as **one static step per rows bucket**
(1, 2, 4, ... ``max_rows``) with a fixed fan-out ``T`` per row (``1 + k`` for a chain, ``1 + nodes`` for a
token tree), so the shapes depend on the bucket alone and the step is captured once per bucket when the
engine starts. Inside the graph:

1. the verify forward: ``R x T`` tokens over the paged cache as one ``VarlenGroup`` (a chain: the paged
   kernel, bottom-right causal; a tree: ``tree_attention`` with the tree's ancestor mask, node j at position
   ``L + depth(j)``), the LM head over every fed token and its argmax ``g [R, T]``;
2. acceptance as tensor ops: node j is *ok* when its token equals ``g`` at its parent and j is one of the
   row's real drafts (``j <= m_r``); it is *alive* when it and every ancestor is ok (one ``[R, T] x [T, T]``
   product with the ancestor mask); the accepted node is the deepest alive one (the first in feed order on
   ties, as ``accepted_path``), its depth the row's accepted count, its path the accepted tokens and
   ``g`` there the correction token (plain greedy's next token). So greedy output equals no speculation;
3. a tree's accepted path is moved to the slots after the root (the copy ``move_tokens`` does; a chain's
   path already sits there);
4. with draft heads, the heads over the hidden state of each row's accepted node: the next step's nodes.

The host then reads one ``[R, 2 + K + nodes]`` int64 tensor (accepted count, emitted tokens, next nodes):
the step's one device-to-host copy. Padding rows repeat row 0 (its inputs, slots and moves), so they write
what row 0 writes and touch nothing else.

Without CUDA (``capture=False``) the same static step runs eagerly: the path the CPU tests compare with plain
greedy decoding. Sampled rows (rejection sampling draws from per-row generators), rows near the context's end
or the pool's, and steps with prefill chunks take the engine's eager packed path.

``SpecPolicy`` decides, per step, whether to speculate at all (see its docstring).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from plyx.serve._graphs import BucketGraphs

if TYPE_CHECKING:
    from plyx.serve.engine._engine import Engine, EngineOutput
    from plyx.serve.engine._sequence import Sequence

__all__ = ["SpecGraphs", "SpecPolicy", "build", "spec_buckets", "spec_step"]

#: a tree step gathers every row's keys over the whole context (``tree_attention``, static width): tree graphs
#: hold at most this many rows x max_seq_len key rows per layer (larger batches verify trees eagerly)
TREE_KEY_ROWS = 1 << 17

#: the scratch sequence id ``warm_up`` runs on (engine ids count up from 0; MixedGraphs uses -(1 << 40))
_SCRATCH_ID = -(1 << 40) - 1


def spec_buckets(max_rows: int) -> list[int]:
    """Rows buckets: powers of two up to ``max_rows`` (and ``max_rows`` itself)."""
    sizes = [1 << i for i in range(max(1, max_rows).bit_length()) if 1 << i <= max_rows]
    return sorted(set(sizes) | {max(1, max_rows)})


def _ancestors(parents: Seq[int]) -> list[list[bool]]:
    """``[T, T]``: row i marks node i and its ancestors (the root, fed index 0, included)."""
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(rows[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows


class SpecGraphs(BucketGraphs):
    """Greedy verification steps of ``T`` fed tokens per row over ``cache``, one static step per rows bucket.

    Args:
        model: a ``plyx.model.TransformerLM`` (``position_ids=``, ``kv_step=``, ``return_hidden=``).
        cache: a block-addressable KV cache (``plyx.attn.supports_static_decode``).
        parents: the fed row's parent indices (``[-1, 0, 1, ..]`` for a chain of ``len - 1`` drafts; a
            ``TokenTree``'s ``parents`` for a tree).
        max_rows: the most rows of one step.
        heads: the ``HeadsProposer`` whose heads propose the next step's nodes inside the step, or None
            (prompt lookup: drafts come from the host).
        capture: capture CUDA graphs (needs CUDA); False runs the same static step eagerly.
    """

    capture_failure = ("CUDA graph capture of a verification step failed, so verification steps run their static step "
                       "eagerly from now on")

    def __init__(self, model: Any, cache: Any, *, parents: Seq[int], max_rows: int, heads: Any = None,
                 capture: bool = True) -> None:
        from plyx.attn import supports_static_decode

        if not supports_static_decode(cache):
            raise TypeError(f"{type(cache).__name__} is not block-addressable; verification graphs need a "
                            "PagedKVCache")
        device = torch.device(cache.layout.device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. Pass capture=False")
        self.model, self.cache, self.heads, self.capture, self.device = model, cache, heads, capture, device
        self.parents = list(parents)
        self.T = T = len(self.parents)
        self.tree = self.parents != list(range(-1, T - 1))
        if self.tree and getattr(cache, "kv_scales", None) is not None:
            # the accepted path's move copies stored values; a quantised pool's scales would have to move too, and
            # tree_attention reads the pools as stored (the engine refuses spec_tree with int8 / fp8 before this)
            raise ValueError("tree verification graphs need an unquantised cache")
        mask = _ancestors(self.parents)
        depths = [sum(row) - 1 for row in mask]
        self.K = max(depths)  # the deepest node: most drafts a row accepts
        self.buckets = spec_buckets(max_rows)
        self.max_rows = r = self.buckets[-1]
        self.block_size = bs = int(cache.block_size)
        self.width = w = -(-cache.layout.max_seq_len // bs)
        self.nodes = len(heads.tree) if heads is not None else 0  # the heads' next proposal per row
        pinned = device.type == "cuda"
        # int64 [ids | positions | slots] of r * T each, then [count] of r; int32 [r, w] tables then [r] lengths
        n = r * T
        self._host = torch.zeros(3 * n + r, dtype=torch.long, pin_memory=pinned)
        self._dev = torch.zeros(3 * n + r, dtype=torch.long, device=device)
        self._host_meta = torch.zeros(r * w + r, dtype=torch.int32, pin_memory=pinned)
        self._dev_meta = torch.zeros(r * w + r, dtype=torch.int32, device=device)
        h = self._host.numpy()
        self._ids, self._pos, self._slots = (h[i * n:(i + 1) * n].reshape(r, T) for i in range(3))
        self._count = h[3 * n:]
        hm = self._host_meta.numpy()
        self._tables, self._lens = hm[:r * w].reshape(r, w), hm[r * w:]
        self._depth = torch.tensor(depths, device=device)  # [T]
        self._depth_host = np.asarray(depths, dtype=np.int64)
        self._mask = torch.tensor(mask, dtype=torch.bool, device=device)  # [T, T]
        self._mask_f = self._mask.float()
        self._parents = torch.tensor([max(p, 0) for p in self.parents], device=device)  # [T]: the root's is itself
        self._score = self._depth * T + (T - 1 - torch.arange(T, device=device))  # deepest, then first fed
        self._levels = torch.arange(1, self.K + 1, device=device)  # [K]
        if heads is not None:
            self._node_head = torch.tensor(heads.tree.heads, device=device)
            self._node_rank = torch.tensor(heads.tree.ranks, device=device)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self.steps = 0
        self.replays = 0
        self.warmup_s = 0.0

    def bucket(self, rows: int) -> int | None:
        """The padded rows count of a step of ``rows`` (None: more than the largest bucket)."""
        return next((b for b in self.buckets if b >= rows), None)

    # -- host side -----------------------------------------------------------------------
    def prepare(self, seq_ids: Seq[int], fed: Seq[Seq[int]], *, bucket: int | None = None) -> int:
        """Reserve ``T`` tokens for each of ``seq_ids`` and load the step's inputs; the bucket.

        Args:
            seq_ids: one per row. fed: each row's real drafts' feed, ``[last token, d_1 .. d_m]`` with
                ``m <= T - 1`` (the rest of the row is padded with token 0 and never accepted).
            bucket: run with this bucket (warm-up).
        """
        from plyx.attn import reserve_tokens

        R, T = len(seq_ids), self.T
        bucket = bucket or self.bucket(R)
        if bucket is None or not 1 <= R <= bucket or any(not 1 <= len(f) <= T for f in fed):
            raise ValueError(f"a verification step of {R} rows (feeds of {sorted({len(f) for f in fed})} tokens) "
                             f"does not fit: at most {self.max_rows} rows of at most {T} tokens")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers may still be in flight
        cache, bs = self.cache, self.block_size
        reserve_tokens(cache, seq_ids, [T] * R)
        ids, pos, slots, tables = self._ids, self._pos, self._slots, self._tables
        for i, (sid, row) in enumerate(zip(seq_ids, fed)):
            blocks = cache.seq_blocks(sid)
            end = cache.length(sid)
            used = -(-end // bs)
            tables[i, :used] = blocks[:used]
            self._lens[i] = end
            ids[i, :len(row)] = row
            ids[i, len(row):] = 0
            p = np.arange(end - T, end)  # feed order takes consecutive slots
            slots[i] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            pos[i] = end - T + self._depth_host  # node j sits at root + depth(j)
            self._count[i] = len(row) - 1
        if bucket > R:  # padding rows repeat row 0: the same writes into the same slots
            for part in (ids, pos, slots, tables):
                part[R:bucket] = part[0]
            self._lens[R:bucket] = self._lens[0]
            self._count[R:bucket] = self._count[0]
        n, w, r = self.max_rows * T, self.width, self.max_rows
        for k in range(3):  # only the used part of each section travels
            self._dev[k * n:k * n + bucket * T].copy_(self._host[k * n:k * n + bucket * T], non_blocking=True)
        self._dev[3 * n:3 * n + bucket].copy_(self._host[3 * n:3 * n + bucket], non_blocking=True)
        self._dev_meta[:bucket * w].copy_(self._host_meta[:bucket * w], non_blocking=True)
        self._dev_meta[r * w:r * w + bucket].copy_(self._host_meta[r * w:r * w + bucket], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return bucket

    # -- device side ---------------------------------------------------------------------
    def _forward(self, R: int) -> torch.Tensor:
        """The static step of ``R`` rows (device work only: capturable); ``[R, 2 + K + nodes]`` int64: the accepted
        count, the emitted tokens (accepted drafts, then the correction; ``K + 1`` columns, read up to the count
        + 1) and the heads' next nodes."""
        from plyx.attn import KVStep, VarlenGroup

        T, K, n, w, r = self.T, self.K, self.max_rows * self.T, self.width, self.max_rows
        d = self._dev
        ids = d[:R * T][None]  # [1, R*T]
        positions = d[n:n + R * T][None]  # [1, R*T]
        slots = d[2 * n:2 * n + R * T]
        count = d[3 * n:3 * n + R]  # [R] real drafts per row
        tables = self._dev_meta[:r * w].view(r, w)[:R]  # [R, W]
        lens = self._dev_meta[r * w:r * w + R]  # [R]
        group = VarlenGroup(0, R, T, tables, lens, self._mask if self.tree else None)
        step = KVStep(cache=self.cache, seq_ids=(), token_index=None, lengths_before=positions[0], lengths_after=(),
                      paged=None, key_mask=None, slots=slots, varlen=(group,))
        lm = getattr(self.model, "lm_head_weight", None)
        out = self.model(ids, position_ids=positions, kv_step=step, return_hidden=lm is not None)[0]  # [R*T, D|V]
        logits = (torch.matmul(out, lm.t()) if lm is not None else out).float()  # [R*T, V]
        g = logits.argmax(dim=-1).view(R, T)  # the target's greedy token after each fed token
        fed = ids[0].view(R, T)
        real = torch.arange(T, device=ids.device)[None, :] <= count[:, None]  # [R, T]
        ok = (fed == g[:, self._parents]) & real
        ok[:, 0] = True  # the root is the row's real last token
        # alive: no ancestor (itself included) failed; one product with the ancestor mask
        dead = torch.matmul((~ok).float(), self._mask_f.t()) > 0  # [R, T]
        best = torch.where(dead, -1, self._score[None, :]).argmax(dim=1)  # [R] fed index of the accepted node
        accepted = self._depth[best]  # [R]
        on_path = self._mask[best]  # [R, T]: the accepted node and its ancestors
        # path[r, l]: the node at depth l + 1 on row r's path (index 0, the root, past its end: never emitted)
        at_level = on_path[:, None, :] & (self._depth[None, None, :] == self._levels[None, :, None])  # [R, K, T]
        path = at_level.float().argmax(dim=-1)  # [R, K]
        emitted = torch.cat([fed.gather(1, path), g.gather(1, best[:, None])], dim=1)  # [R, K + 1]
        emitted = emitted.scatter(1, accepted[:, None], g.gather(1, best[:, None]))  # the correction after them
        if self.tree:  # the accepted path's keys and values to the slots after the root (a chain's are there)
            slot = slots.view(R, T)
            keep = self._levels[None, :] <= accepted[:, None]  # [R, K]
            dst = slot[:, 1:K + 1]
            src = torch.where(keep, slot.gather(1, path), dst)  # past the path: a copy onto itself
            self._move(src.reshape(-1), dst.reshape(-1))
        parts = [accepted[:, None], emitted]
        if self.heads is not None:  # the next step's nodes from the accepted node's hidden state
            h = out.view(R, T, -1).gather(1, best[:, None, None].expand(R, 1, out.shape[-1]))[:, 0]  # [R, D]
            hl = self.heads.heads(h.to(next(self.heads.heads.parameters()).dtype))[:self.heads.k]  # [k, R, V]
            if self.heads.is_tree:
                top = hl.topk(self.heads.topk, dim=-1).indices  # [k, R, topk]
            else:
                top = hl.argmax(dim=-1, keepdim=True)  # [k, R, 1]
            parts.append(top[self._node_head, :, self._node_rank].t())  # [R, nodes]
        return torch.cat(parts, dim=1)

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        cache = self.cache
        for layer in range(cache.layout.num_layers):
            for pool in cache.kv_blocks(layer):
                flat = pool.view(-1, *pool.shape[2:])  # (num_blocks * block_size, KV, Dh)
                flat.index_copy_(0, dst, flat.index_select(0, src))

    @torch.inference_mode()
    def run(self, seq_ids: Seq[int], fed: Seq[Seq[int]]) -> list[list[int]]:
        """One verification step; per row ``[accepted, emitted (K + 1), next nodes]`` on the host (the one
        device-to-host copy of the step)."""
        bucket = self.prepare(seq_ids, fed)
        return self._run(bucket)[:len(seq_ids)].tolist()  # type: ignore[no-any-return]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run (and capture) every bucket once on a scratch sequence, largest first; the seconds it took."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.cache.allocate(_SCRATCH_ID)
            try:
                self.prepare([_SCRATCH_ID], [[0]], bucket=bucket)
                self._run(bucket)
            finally:
                self.cache.evict(_SCRATCH_ID)
            self.steps -= 1
            if self.capture is False and self.device.type == "cuda":
                break
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - start
        return self.warmup_s

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)


def spec_step(engine: Engine, planned: list[tuple[Sequence, int]]) -> list[EngineOutput] | None:
    """Run ``planned`` as one ``SpecGraphs`` step when it is a decode-only step of plain-greedy rows that fits
    (rows, context, free blocks); the outputs, or None for the engine's eager packed path."""
    from plyx.serve.engine._sampling import plain_greedy
    from plyx.serve.engine._sequence import SeqStatus

    graphs: SpecGraphs = engine.spec_graphs
    drafts = engine._drafts
    if not drafts or graphs.bucket(len(planned)) is None:
        return None
    T = graphs.T
    for seq, n in planned:
        if (seq.pending != 1 or seq.num_computed == 0 or not plain_greedy(seq) or seq.params.logprobs is not None
                or seq.request.adapter is not None or n != 1 + len(drafts.get(seq.seq_id, ()))
                or len(seq.tokens) - 1 + T > engine.max_model_len):
            return None
    seqs = [s for s, _ in planned]
    ids = [s.seq_id for s in seqs]
    if engine.cache.blocks_needed(ids, [T] * len(ids)) > engine.cache.num_free_blocks():
        return None  # the static step feeds T tokens a row; never evict or preempt for its padding
    fed = [[s.tokens[-1]] + drafts.get(s.seq_id, []) for s in seqs]
    rows = graphs.run(ids, fed)
    proposer = engine.proposer
    stats = engine.stats
    outputs: list[EngineOutput] = []
    K = graphs.K
    for seq, row, f in zip(seqs, rows, fed):
        accepted = row[0]
        tokens = row[1:2 + accepted]
        seq.num_computed += 1 + accepted  # the root and the accepted path (moved after it) stay
        if len(f) > 1:
            stats.spec_drafted += len(f) - 1
            stats.spec_accepted += accepted
            stats.spec_rows += 1
        outputs.extend(engine._accept_tokens(seq, tokens))
        if seq.status is not SeqStatus.FINISHED:
            engine.cache.crop(seq.seq_id, seq.num_computed)
            if proposer is not None:
                proposer.offer(seq, row[2 + K:])
    return outputs


def build(engine: Engine) -> SpecGraphs | None:
    """The engine's ``SpecGraphs`` where its packed steps run static (``mixed_graphs``) and it speculates with a
    chain of at most ``PAGED_MAX_QUERY - 1`` drafts or a heads' tree; warmed up (captured) on CUDA."""
    from plyx.attn import PAGED_MAX_QUERY

    if not engine.spec_k or engine.mixed_graphs is None:
        return None
    proposer = engine.proposer
    if proposer is not None and proposer.is_tree:
        parents = proposer.tree.parents
    elif engine.spec_k + 1 <= PAGED_MAX_QUERY:
        parents = list(range(-1, engine.spec_k))
    else:
        return None
    cuda = engine.device.type == "cuda"
    rows = engine.config.max_batch_size
    if proposer is not None and proposer.is_tree:
        rows = min(rows, max(1, TREE_KEY_ROWS // int(engine.cache.layout.max_seq_len)))
    graphs = SpecGraphs(engine.model, engine.cache, parents=parents, max_rows=rows, heads=proposer, capture=cuda)
    if cuda:
        graphs.warm_up()
    return graphs


class SpecPolicy:
    """Whether the engine speculates this step: speculation must beat plain decoding in measured tokens/s.

    Per rows bucket ``b`` (powers of two) it keeps moving averages of the wall time of a decode-only step with
    speculation, ``t_spec[b]``, and without, ``t_plain[b]``, and of the tokens a row emits per speculating
    step, ``a[b]`` (1 + its accepted drafts: the measured acceptance length). The rule:

        speculate  iff  a[b] / t_spec[b]  >  (1 + margin) / t_plain[b]

    i.e. the expected tokens per verify step, over the verify step's measured cost relative to a plain step,
    must exceed 1. A plain schedule may run a multi-step block (``EngineConfig.decode_steps``, CUDA's default):
    ``t_plain`` is then its time per token-step, so speculation must beat the engine's fastest plain decoding. The first ``warm`` decode steps of each bucket speculate and the next ``warm`` do not (to
    measure both); after that the losing mode still runs one step in ``probe_every`` so its estimate follows
    the workload (acceptance changes with the text, step costs with the batch). Draft heads draft from the
    previous step's features, so after a plain step their first speculating step has no drafts: it is not
    measured, and the next step speculates too. A step's time is the interval
    between two consecutive decisions, counted only when the step was decode-only and the batch did not
    change (no admission, prefill or finished row), and clipped to 4x the running estimate (an idle gap
    between two client calls is not a step).

    Args:
        mode: ``"auto"`` (the rule), ``"always"`` (speculate every step: what the exactness tests use) or
            ``"never"``.
        margin: how much faster speculation must measure to be chosen.
        clock: seconds (tests pass a fake one).
    """

    def __init__(self, mode: str = "auto", *, warm: int = 4, probe_every: int = 32, margin: float = 0.05,
                 alpha: float = 0.25, clock: Callable[[], float] = time.perf_counter) -> None:
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"speculation policy {mode!r}: use 'auto', 'always' or 'never'")
        self.mode, self.warm, self.probe_every, self.margin, self.alpha = mode, warm, probe_every, margin, alpha
        self.clock = clock
        self.t_spec: dict[int, float] = {}
        self.t_plain: dict[int, float] = {}
        self.accept: dict[int, float] = {}
        self.seen: dict[tuple[bool, int], int] = {}  # (mode, bucket) -> steps measured
        self.decisions: dict[int, int] = {}  # bucket -> decisions taken
        self.off_steps = 0  # decode steps the rule ran without speculation
        self._last: tuple[bool, int, float, tuple[int, ...]] | None = None

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _ema(self, table: dict[int, float], key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.alpha * (value - old)

    def _snapshot(self, engine: Any) -> tuple[int, ...]:
        s = engine.stats
        return (s.steps, s.prompt_tokens, s.generated_tokens, len(engine.running), len(engine.waiting),
                s.requests_finished)

    def _record(self, engine: Any, now: float) -> None:
        if self._last is None:
            return
        spec, b, t0, before = self._last
        if spec and not engine._drafts and engine.proposer is not None:
            return  # heads without features yet (the step after a plain one): not a verify step
        after = self._snapshot(engine)
        # decode-only steps over an unchanged batch (none finished, none admitted or prefilled); a plain schedule
        # may run a multi-step block of several steps: its time and tokens per step
        steps = after[0] - before[0]
        if steps < 1 or after[1] != before[1] or after[3:] != before[3:] or not before[3]:
            return
        dt = (now - t0) / steps
        table = self.t_spec if spec else self.t_plain
        if b in table:
            dt = min(dt, 4 * table[b])
        self._ema(table, b, dt)
        if spec:
            self._ema(self.accept, b, (after[2] - before[2]) / before[3])
        self.seen[(spec, b)] = self.seen.get((spec, b), 0) + 1

    def decide(self, engine: Any) -> bool:
        """Whether the step being scheduled speculates (called once per step, before the schedule)."""
        if self.mode != "auto":
            return self.mode == "always"
        now = self.clock()
        self._record(engine, now)
        b = self.bucket(max(1, len(engine.running)))
        n = self.decisions[b] = self.decisions.get(b, 0) + 1
        # draft heads need one step's features before they draft: a speculating step that had no drafts is
        # followed by another, so the rule measures a real verify step (prompt lookup finding nothing is real)
        pending = self._last is not None and self._last[0] and not engine._drafts and engine.proposer is not None
        spec = pending or self.choose(b, n)
        if not spec:
            self.off_steps += 1
        self._last = (spec, b, now, self._snapshot(engine))
        return spec

    def choose(self, b: int, n: int) -> bool:
        """The rule for bucket ``b`` at its ``n``-th decision."""
        if self.seen.get((True, b), 0) < self.warm:
            return True
        if self.seen.get((False, b), 0) < self.warm:
            return False
        better = self.accept[b] / self.t_spec[b] > (1 + self.margin) / self.t_plain[b]
        return better != (n % self.probe_every == 0)  # the loser's probe step
