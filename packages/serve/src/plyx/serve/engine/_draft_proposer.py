"""Draft heads (Medusa) as the engine's proposer, with chain or tree verification in the packed step.

The heads read the target's final-norm hidden state at the position that produced a row's last token
(``plyx.model.MedusaHeads``: head j scores the token j steps after it), so no draft model runs: the
packed forward that computes a step's logits already holds the features of the next step's drafts.

Per engine step, for every plain-greedy decoding row (``Engine._speculates``):

1. ``capture``: the hidden state ``[D]`` of the position whose argmax became the row's last token is kept
   (a sampled row's last position; a verified row's last accepted node). Only those rows, already selected
   for the LM head, are kept: no extra gather over the step's tokens.
2. ``draft`` (once per step, batched over the rows captured): the heads give ``[K, B, V]``; each head's
   top-``topk`` candidates fill the nodes of a static ``TokenTree``. With ``topk == 1`` the tree is a chain
   (head j's argmax at depth j), verified exactly like prompt-lookup drafts.
3. ``propose`` (the next schedule): the row feeds ``[last token, nodes...]``; a tree row also hands its parent
   indices to ``plyx.attn.begin_packed_step(tree_parents=...)``, which places node j at position
   ``L + depth(j)`` and lets it attend only the prefix and its ancestors (Medusa's tree attention).
4. ``accepted_path``: the deepest node whose every token on the way equals the target's argmax at its
   parent is the accepted path; the row emits its tokens plus the argmax at its last node, which is the
   token plain greedy decoding would emit next. So greedy output is identical to no speculation.

Sampled rows (temperature > 0) speculate with chains only, under the standard rejection rule (Leviathan et al.
2023, as ``plyx.serve._draft_heads.HeadsDecoder``): d_j is drawn from the head's processed distribution q_j,
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))`` against the target's processed p_j until the first
rejection, where the token is drawn from ``norm(max(0, p_j - q_j))``; after k acceptances a bonus token comes from
p_{k+1}. Every emitted token is then distributed as without speculation (chi-square tested). Rows whose
processing depends on the generated tokens (penalties, min_tokens, grammar, plugin processors or samplers) or
that ask for log-probs never speculate, and with ``spec_tree`` only greedy rows do (a tree's rejection rule
needs per-node residual distributions).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch
from plyx.serve._pipeline import LogitsPipeline
from plyx.serve._processors import SamplingState, exponential_noise, uniform_noise
from plyx.specs.errors import ConfigError

__all__ = ["HeadsProposer", "TokenTree", "accepted_path"]

#: most tree nodes fed per row (the tree's prefix in breadth-first order is kept)
MAX_TREE_NODES = 64


class TokenTree:
    """A static token tree over K heads: the rank paths ``(r_1, .., r_d)`` (``d <= depth``, each ``r_i <
    topk``) with ``sum(r_i) <= topk - 1``, breadth-first.

    The rank budget keeps the tree small while covering what matters: the top-1 chain (all zeros: the chain
    drafts, so a tree never accepts less than the chain on the same features), every path that takes one
    lower-ranked candidate at one depth, and so on (topk 2, depth 4: 14 nodes; topk 3: 34). Node ``i`` holds
    head ``heads[i]``'s candidate of rank ``ranks[i]``; ``parents`` are indices into the fed row
    ``[root, node 0, node 1, ...]`` (``parents[0] == -1``).
    """

    def __init__(self, depth: int, topk: int, max_nodes: int = MAX_TREE_NODES) -> None:
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(topk), repeat=d)
                 if sum(p) <= topk - 1][:max_nodes]
        index = {p: i + 1 for i, p in enumerate(paths)}  # fed index: the root is 0
        self.depth, self.topk = depth, topk
        self.paths = paths
        self.heads = [len(p) - 1 for p in paths]
        self.ranks = [p[-1] for p in paths]
        self.depths = [len(p) for p in paths]
        self.parents = [-1] + [index.get(p[:-1], 0) for p in paths]

    def __len__(self) -> int:
        return len(self.paths)

    def size(self, max_depth: int, max_nodes: int) -> int:
        """Nodes kept for a row that may emit ``max_depth`` drafts and feed ``max_nodes``: a breadth-first
        prefix (closed under parents)."""
        return max(0, min(bisect.bisect_right(self.depths, max_depth), max_nodes))


def accepted_path(drafts: Seq[int], parents: Seq[int], greedy: Seq[int]) -> list[int]:
    """The accepted nodes (fed indices, root excluded, root to leaf) of a row that fed ``[root] + drafts``.

    Args:
        drafts: the nodes' tokens (fed indices 1..n). parents: ``n + 1`` parent indices (``-1`` for the root).
        greedy: the target's argmax after each fed token (``n + 1``).

    Returns:
        The deepest path whose every node's token equals the argmax at its parent (the first such path in
        feed order on ties); empty when even depth 1 fails. For a chain (``parents[j] == j - 1``) it is
        the accepted prefix.
    """
    ok = [True] + [False] * len(drafts)
    depth = [0] * (len(drafts) + 1)
    best = 0
    for j in range(1, len(drafts) + 1):
        p = parents[j]
        if ok[p] and drafts[j - 1] == greedy[p]:
            ok[j], depth[j] = True, depth[p] + 1
            if depth[j] > depth[best]:
                best = j
    path = []
    while best > 0:
        path.append(best)
        best = parents[best]
    return path[::-1]


class HeadsProposer:
    """Medusa heads proposing the engine's drafts (see the module docstring).

    Args:
        heads: a ``plyx.model.MedusaHeads`` on the target's device (``resolve_heads`` checks it).
        k: most draft tokens per row and step (tree depth), at most the heads' count.
        topk: candidates per head; 1: a chain.
    """

    def __init__(self, heads: Any, *, k: int, topk: int) -> None:
        self.heads = heads.eval()
        self.k = k
        self.topk = max(1, topk)
        self.tree = TokenTree(k, self.topk)
        self._fresh: dict[int, tuple[Any, torch.Tensor]] = {}  # seq_id -> (seq, feature [D]) captured this step
        # seq_id -> (its length then, node tokens, a sampled row's q [k, V] or None)
        self._proposals: dict[int, tuple[int, list[int], torch.Tensor | None]] = {}
        self.verify_hidden: torch.Tensor | None = None  # [M, D] hidden states of the step's verified positions
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._q: dict[int, torch.Tensor] = {}  # seq_id -> q [n, V] of the drafts a sampled row feeds this step
        self.verify_logits: torch.Tensor | None = None  # [M, V] the target's logits at those positions

    @classmethod
    def build(cls, source: Any, model: Any, *, k: int, topk: int) -> HeadsProposer:
        """Load (a path) or check (a module) Medusa heads for ``model``; errors name ``EngineConfig`` fields."""
        from plyx.serve._draft_heads import resolve_heads

        heads = resolve_heads(source, model, where="EngineConfig.draft_heads")
        if heads.kind != "medusa":
            raise ConfigError("EngineConfig.draft_heads", f"{heads.kind} drafts run their own layer and KV cache per "
                              "sequence: the engine proposes with Medusa heads only", value=heads.kind,
                              fix="train Medusa heads (plyx train, [draft] kind = 'medusa'), or decode with the EAGLE "
                              "draft through plyx.serve.generate(..., draft_model=PATH)")
        if getattr(model, "lm_head_weight", None) is None:
            raise ConfigError("EngineConfig.draft_heads", "draft heads need the target's hidden states and LM head "
                              "(`lm_head_weight`)", value=type(model).__name__, fix="serve a plyx.model.TransformerLM")
        if topk > 1 and getattr(model.config, "sliding_window", None):
            raise ConfigError("EngineConfig.spec_tree", "tree verification attends ancestors by mask and does not "
                              "apply a sliding window", value=topk, fix="use spec_tree=0 (chain) for this model")
        depth = min(k or heads.num_heads, heads.num_heads)
        return cls(heads, k=depth, topk=topk)

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def samples(self, seq: Any) -> bool:
        """A sampled row the chain speculates for under the rejection rule: temperature > 0, processing that
        does not depend on the generated tokens, no grammar, no log-probs, the base model."""
        from plyx.serve._draft_heads import _STATEFUL

        p = seq.params
        return (not self.is_tree and not p.greedy and seq.matcher is None and p.logprobs is None
                and seq.request.adapter is None and all(getattr(p, n) == d for n, d in _STATEFUL.items()))

    @staticmethod
    def _pipeline(seqs: Seq[Any], vocab: int, device: torch.device, generator: torch.Generator | None
                  ) -> tuple[LogitsPipeline, SamplingState]:
        pipe = LogitsPipeline([s.params for s in seqs], [sorted(s.completion.stop_ids) for s in seqs])
        state = SamplingState.for_prompts([[] for _ in seqs], vocab, device, [s.generator for s in seqs], generator)
        return pipe, state

    def capture(self, seqs: Seq[Any], hidden: torch.Tensor) -> None:
        """Keep ``hidden[i]`` (``[R, D]``) as the feature of ``seqs[i]``: the state that produced its last token."""
        for seq, row in zip(seqs, hidden):
            self._fresh[seq.seq_id] = (seq, row)

    @torch.inference_mode()
    def draft(self, running: Seq[Any], generator: torch.Generator | None = None) -> None:
        """Run the heads once over the rows captured this step that still run; keep each row's node tokens
        (a sampled row's drafts drawn from its processed head distributions q, with its generator or
        ``generator``)."""
        live = {s.seq_id for s in running}
        self._proposals = {sid: p for sid, p in self._proposals.items() if sid in live}
        rows = [(s, f) for s, f in self._fresh.values() if s.seq_id in live and not s.finished]
        self._fresh = {}
        self.verify_hidden = self.verify_logits = None
        self._q = {}
        if not rows:
            return
        hs = torch.stack([f for _, f in rows])  # (B, D)
        logits = self.heads(hs.to(next(self.heads.parameters()).dtype))[:self.k]  # (k, B, V)
        top = logits.topk(self.topk, dim=-1).indices if self.is_tree else logits.argmax(-1, keepdim=True)  # (k, B, topk)
        if self._index is None or self._index[0].device != top.device:  # the tree's (head, rank) per node, once
            self._index = (torch.tensor(self.tree.heads, device=top.device),
                           torch.tensor(self.tree.ranks, device=top.device))
        nodes = top[self._index[0], :, self._index[1]]  # (n, B): node i is head heads[i]'s rank ranks[i] candidate
        drafts = nodes.t()  # (B, n)
        sampled = [i for i, (s, _) in enumerate(rows) if not s.params.greedy]
        q = None
        if sampled:  # chains only (``samples``): d_j ~ q_j, the head's distribution through the row's processors
            seqs = [rows[i][0] for i in sampled]
            idx = torch.tensor(sampled, device=logits.device)
            pipe, state = self._pipeline(seqs, logits.shape[-1], logits.device, generator)
            q = torch.empty(len(sampled), self.k, logits.shape[-1], device=logits.device)  # (b, k, V)
            drawn = torch.empty(len(sampled), self.k, dtype=torch.long, device=logits.device)
            for j in range(self.k):
                processed = pipe.process(logits[j].index_select(0, idx), state)  # (b, V)
                q[:, j] = processed.softmax(dim=-1)
                drawn[:, j] = pipe.sample(processed, state)
            drafts = drafts.index_copy(0, idx, drawn)
        qs = dict(zip(sampled, q.unbind(0))) if q is not None else {}
        for i, ((seq, _), tokens) in enumerate(zip(rows, drafts.tolist())):
            self._proposals[seq.seq_id] = (len(seq.tokens), tokens, qs.get(i))

    def offer(self, seq: Any, nodes: Seq[int]) -> None:
        """Keep ``nodes`` (the tree's tokens, feed order) as ``seq``'s next proposal: a verification graph ran the
        heads on the hidden state of its accepted node (``plyx.serve.engine._spec_graphs``)."""
        self._proposals[seq.seq_id] = (len(seq.tokens), list(nodes), None)

    def propose(self, seq: Any, max_depth: int, max_nodes: int) -> tuple[list[int], list[int] | None]:
        """This step's drafts of ``seq`` and, for a tree, the fed row's parents; ``([], None)`` when its heads
        have not run on its current last token."""
        entry = self._proposals.pop(seq.seq_id, None)
        if entry is None or entry[0] != len(seq.tokens):
            return [], None
        n = self.tree.size(max_depth, max_nodes)
        if n == 0:
            return [], None
        if entry[2] is not None:  # kept for the rejection rule when the drafts come back verified
            self._q[seq.seq_id] = entry[2][:n]
        return entry[1][:n], (self.tree.parents[:n + 1] if self.is_tree else None)

    @torch.inference_mode()
    def verify_sampled(self, seq: Any, drafts: Seq[int], logits: torch.Tensor, generator: torch.Generator | None
                       ) -> tuple[int, int]:
        """The rejection rule for a sampled row: how many of ``drafts`` it keeps and the token after them.

        Args:
            seq: the row. drafts: its n fed drafts. logits: ``[n + 1, V]`` the target's logits after its real
                token and after each draft. generator: the engine's, for an unseeded row.

        Returns:
            ``(accepted, token)``: d_j kept with probability ``min(1, p_j(d_j) / q_j(d_j))`` until the first
            rejection; ``token`` drawn from ``norm(max(0, p - q))`` there, or from p_{n+1} after all n.
        """
        n, V = len(drafts), logits.shape[-1]
        q = self._q.pop(seq.seq_id)  # (n, V)
        pipe, state = self._pipeline([seq], V, logits.device, generator)
        p = pipe.process(logits, state.select([0] * (n + 1))).softmax(dim=-1)  # (n + 1, V)
        d = torch.tensor(drafts, device=logits.device)
        p_d, q_d = p[:n].gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]  # (n,)
        u = uniform_noise((1, n), logits.device, state)[0]
        accepted = int((u * q_d < p_d).long().cumprod(dim=0).sum())  # u < p/q without dividing by a tiny q
        residual = p[accepted] - (q[accepted] if accepted < n else 0)
        residual = residual.clamp(min=0)
        mass = residual.sum()
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[accepted])  # p == q: draw from p
        noise = exponential_noise((1, V), logits.device, state)[0]
        return accepted, int((residual / noise).argmax())
