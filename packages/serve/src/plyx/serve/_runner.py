"""How the decode loops call a model: with a KV cache (prefill + one-token steps) or without (full recompute).

A model is anything with ``config`` (a ``plyx.specs.ModelConfig``) called as
``model(input_ids [B, T], *, attention_mask=None, cache=None, seq_ids=None) -> logits [B, T, V]``,
``plyx.model.TransformerLM`` first among them. With a cache the model reserves each row's real
tokens and positions continue from each sequence's cached length, so rows of different lengths
decode together with no padding in the cache.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from plyx.specs.errors import ConfigError
from plyx.specs.kvcache import KVCache

__all__ = ["Runner", "model_device", "model_dtype"]


def model_device(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def model_dtype(model: Any) -> torch.dtype:
    for p in model.parameters():
        return p.dtype
    return torch.float32


def left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` ids and mask (None when no row is padded), rows right-aligned (left padding with 0)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    padded = bool((mask == 0).any())
    return ids.to(device), (mask.to(device) if padded else None)


def last_logits(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``[B, V]`` float logits of each row's last position. With ``lm_head_weight`` only that hidden state goes
    through the LM head (as transformers' ``logits_to_keep=1``), not a ``[B, T, V]`` tensor: T times less
    LM-head work on a prompt."""
    head = getattr(model, "lm_head_weight", None)
    if head is None:
        return model(ids, **kwargs)[:, -1]  # type: ignore[no-any-return]
    hidden = model(ids, return_hidden=True, **kwargs)[:, -1]  # [B, D]
    return torch.matmul(hidden, head.t()).float()


#: per model: idle (weight addresses, cache, DecodeGraphs) by (kind, sequences, max_seq_len), reused by the next
#: generate call of that shape on a GPU; dropped with the model
SPARES_PER_MODEL = 4
_SPARES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def _weight_addresses(model: Any) -> tuple[int, ...]:
    """Where every parameter's storage is (a shared one once per use). A plain walk of the module tree:
    ``model.parameters()`` deduplicates through memo sets, ~10x slower, and this runs twice per call."""
    addresses: list[int] = []
    stack = [model]
    while stack:
        module = stack.pop()
        addresses.extend(p.data_ptr() for p in module._parameters.values() if p is not None)
        stack.extend(m for m in module._modules.values() if m is not None)
    return tuple(addresses)


class Runner:
    """One model and (optionally) its KV cache; sequence ids are allocated here and evicted on ``close``.

    Args:
        model: the model.
        cache: a KV-cache kind name (``contiguous``, ``paged``, a plugin's), a ``KVCache`` instance (ids
            already live in it are left alone), or None to recompute the whole sequence at every step.
        num_sequences: most sequences alive at once (sizes a cache built from a kind name).
        max_seq_len: most tokens per sequence (prompt + generated).
    """

    def __init__(self, model: Any, cache: str | KVCache | None, *, num_sequences: int, max_seq_len: int,
                 where: str = "cache", cuda_graphs: bool | None = False) -> None:
        self.model = model
        self.device = model_device(model)
        self.owned = isinstance(cache, str)
        if isinstance(cache, str):
            from plyx.attn import cache_kinds, make_cache

            kinds = cache_kinds()
            if cache not in kinds:
                raise ConfigError(
                    where, f"KV-cache kind {cache!r} not found. It is either misspelled or not installed",
                    value=cache, fix=f"use one of {', '.join(sorted(kinds)) or '(none installed)'} or use_cache=False",
                )
            if cuda_graphs is not False:  # whole 16-token blocks: the graphed step reads the cache by block
                max_seq_len = -(-max_seq_len // 16) * 16
            self._spare_key = (cache, num_sequences, max_seq_len)
            reuse = cuda_graphs is not False and self.device.type == "cuda"
            spare = _SPARES.get(model, {}).pop(self._spare_key, None) if reuse else None
            # graphs read the weights where they were at capture: a moved or reassigned parameter voids them
            if spare is not None and spare[0] == _weight_addresses(model):
                # the cache and captured graphs an earlier call of the same shape left idle
                _, self.cache, self.graphs = spare
                self._next_id, self._ids, self._tokens = 0, set(), {}
                return
            cache = make_cache(cache, model.config, batch_size=num_sequences, max_seq_len=max_seq_len,
                               device=self.device, dtype=model_dtype(model))
        elif cache is not None and not isinstance(cache, KVCache):
            raise ConfigError(where, "cache must be a KV-cache kind name or an object satisfying plyx.specs.KVCache",
                              value=type(cache).__name__, fix='pass cache="contiguous", cache="paged" or a KVCache')
        self.cache: KVCache | None = cache
        self.graphs = self._decode_graphs(cuda_graphs, num_sequences)
        self._next_id = 1 + max(cache.sequences(), default=-1) if cache is not None else 0
        self._ids: set[int] = set()
        # without a cache: the full token list of each live sequence, recomputed every step
        self._tokens: dict[int, list[int]] = {}

    def _decode_graphs(self, wanted: bool | None, num_sequences: int) -> Any:
        """The ``DecodeGraphs`` of ``step`` when CUDA graphs are wanted (None: where possible), else None."""
        if wanted is False:
            return None
        from plyx.attn import supports_static_decode

        takes_step = "kv_step" in inspect.signature(self.model.forward).parameters
        why = ("use_cache=False (no cache)" if self.cache is None else
               f"the model is on {self.device}, not a CUDA device" if self.device.type != "cuda" else
               f"{type(self.cache).__name__} is not block-addressable" if not supports_static_decode(self.cache)
               else f"{type(self.model).__name__}.forward takes no kv_step" if not takes_step else None)
        if why is not None:
            if wanted:
                raise ConfigError("cuda_graphs", f"CUDA graphs cannot run here: {why}", value=True,
                                  fix="pass cuda_graphs=None (use them where possible) or False")
            return None
        from plyx.serve._graphs import DecodeGraphs

        return DecodeGraphs(self.model, self.cache, max_batch=max(1, num_sequences))

    # -- sequence ids ----------------------------------------------------------------
    def new_id(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._ids.add(sid)
        return sid

    def fork(self, src: int) -> int:
        """A new sequence sharing ``src``'s tokens (``KVCache.fork``: prefix sharing)."""
        dst = self.new_id()
        if self.cache is not None:
            self.cache.fork(src, dst)
        else:
            self._tokens[dst] = list(self._tokens[src])
        return dst

    def release(self, sid: int) -> None:
        if sid in self._ids:
            self._ids.discard(sid)
            if self.cache is not None:
                if sid in self.cache.sequences():
                    self.cache.evict(sid)
            else:
                self._tokens.pop(sid, None)

    def close(self) -> None:
        for sid in list(self._ids):
            self.release(sid)
        if self.graphs is not None and self.owned and not self.cache.sequences():  # type: ignore[union-attr]
            # keep the (now empty) cache and its captured graphs for the next call of this shape, as
            # transformers keeps its static cache: capturing costs a forward and ~400 kernel records per bucket
            # at most SPARES_PER_MODEL shapes per model, the least recently used dropped first (bounded memory:
            # a caller alternating two cache kinds or lengths keeps both); the addresses are read now, after
            # DecodeGraphs packed the weights
            spares = _SPARES.setdefault(self.model, {})
            spares.pop(self._spare_key, None)
            spares[self._spare_key] = (_weight_addresses(self.model), self.cache, self.graphs)
            while len(spares) > SPARES_PER_MODEL:
                del spares[next(iter(spares))]

    def length(self, sid: int) -> int:
        if self.cache is not None:
            return self.cache.length(sid) if sid in self.cache.sequences() else 0
        return len(self._tokens.get(sid, ()))

    def crop(self, sid: int, length: int) -> None:
        if self.cache is not None:
            self.cache.crop(sid, length)
        else:
            del self._tokens[sid][length:]

    # -- forward passes ------------------------------------------------------------------
    def extend(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]], *, all_logits: bool = False) -> Any:
        """Feed each sequence its new tokens (ragged lengths allowed) in one left-padded forward pass.

        With a cache, padding is masked and never stored (the model reserves only each row's real tokens,
        and positions continue from each sequence's cached length); without one, every live sequence is
        recomputed in full, left-padded, as transformers does with ``use_cache=False``.

        Returns ``[B, V]`` (the last new position of each row) or, with ``all_logits``, a list of
        ``[T_i, V]`` (every new position).
        """
        if self.cache is None:
            for sid, new in zip(seq_ids, tokens):
                self._tokens.setdefault(sid, []).extend(int(t) for t in new)
            rows: Sequence[Sequence[int]] = [self._tokens[s] for s in seq_ids]
            ids, mask = left_pad(rows, self.device)
            kwargs: dict[str, Any] = {"attention_mask": mask}
        else:
            if self.graphs is not None and not all_logits:
                # short prompts of one length: replayed chunk graphs instead of an eager forward, whose
                # ~300 launches from Python cost more than the GPU work at batch 1 (DecodeGraphs.prefill)
                logits = self.graphs.prefill(seq_ids, tokens)
                if logits is not None:
                    return logits
            ids, mask = left_pad(tokens, self.device)
            kwargs = {"attention_mask": mask, "cache": self.cache, "seq_ids": list(seq_ids)}
        if all_logits:
            logits = self.model(ids, **kwargs)  # [B, T, V]
            width = logits.shape[1]
            return [logits[i, width - len(t):] for i, t in enumerate(tokens)]
        return last_logits(self.model, ids, **kwargs)

    def greedy_step(self, seq_ids: Sequence[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``step`` plus each row's greedy token, both from one replayed graph; None where no graph runs it."""
        if self.graphs is None or self.graphs.bucket(len(seq_ids)) is None:
            return None
        return self.graphs.step(seq_ids, tokens, greedy=True)  # type: ignore[no-any-return]

    def greedy_steps(self, seq_ids: Sequence[int], tokens: torch.Tensor, steps: int) -> torch.Tensor | None:
        """``steps`` greedy one-token steps in one replayed graph (``DecodeGraphs.greedy_steps``): ``[B, steps]``
        tokens; None where no graph runs them (no graphs, a batch beyond the buckets, more steps than it holds)."""
        graphs = self.graphs
        if graphs is None or graphs.bucket(len(seq_ids)) is None or steps > graphs.max_query:
            return None
        return graphs.greedy_steps(seq_ids, tokens, steps)  # type: ignore[no-any-return]

    def step(self, seq_ids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token per sequence (``tokens`` [B] on device, no host copy); returns ``[B, V]``."""
        if self.cache is None:
            return self.extend(seq_ids, [[t] for t in tokens.tolist()])
        if self.graphs is not None and self.graphs.bucket(len(seq_ids)) is not None:
            return self.graphs.step(seq_ids, tokens)  # a view of the graph's output: read before the next step
        return self.model(tokens[:, None], cache=self.cache, seq_ids=list(seq_ids))[:, -1]
