"""``EngineConfig``: the scheduler's limits and the paged KV cache's geometry."""

from __future__ import annotations

from typing import Any

import msgspec
from plyx.specs.errors import ConfigError

__all__ = ["DEFAULT_CUDA_DECODE_STEPS", "EngineConfig", "KV_CACHE_DTYPES"]

#: the values of ``EngineConfig.kv_cache_dtype`` (``--kv-cache-dtype``)
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3")
#: ``decode_steps`` on CUDA when the config leaves it None. 16 rather than 8: at 32 serving rows on an H100
#: (1.1B shape, decode-heavy, same run) the host's work per block (accepting, detokenising and streaming 32
#: rows) paced 8-step blocks and left the device idle between them; 16 steps halve that work per token
#: (0.79 of the reference decode against 0.65, serve 1.8, 2026-11-25)
DEFAULT_CUDA_DECODE_STEPS = 16


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the continuous-batching engine schedules work.

    Example:
        >>> EngineConfig(max_batch_size=32, max_batch_tokens=512, block_size=16, num_blocks=2048)
    """

    max_batch_size: int = 64
    """Most sequences in the running batch (decoding or prefilling)."""
    max_batch_tokens: int = 2048
    """Token budget of one step: decodes (1 each) plus prefill chunks; a longer prompt is chunked."""
    block_size: int = 16
    """Tokens per KV-cache block (and per prefix-cache entry)."""
    num_blocks: int = 0
    """Blocks in the KV pool; 0 sizes it for max_batch_size sequences of max_model_len tokens (plus the one
    copy-on-write block a fork may need)."""
    max_model_len: int = 0
    """Longest prompt + completion; 0 means the model's max_seq_len."""
    prefix_caching: bool = True
    """Keep full prompt blocks after a request ends and reuse them for identical prefixes (LRU)."""
    max_queue: int = 256
    """Most requests waiting for admission; ``Engine.add_request`` raises ``QueueFullError`` beyond it."""
    mixed_chunk: int = 0
    """While sequences are decoding, cap prefill chunks at this many tokens (<= 16, the paged-attention query
    limit) and run them in the decodes' forward, left-padded: one forward per step instead of one per prefill.
    Worth it where a forward's fixed cost dominates (GPU: kernel launches and Python); on CPU the padded
    decode rows cost compute, so 0 (off) keeps separate forwards."""

    packed_step: bool = True
    """Run each step as one packed (varlen) forward: prefill chunks and decode rows of every scheduled sequence
    flattened into one token batch, attention over the paged cache per group of equal counts. False: one
    forward per group of equal new-token counts (the path before packing; adapters always take it)."""

    speculative_ngram: int = 0
    """Prompt-lookup (n-gram) speculation in the engine: each plain-greedy decoding row (no processors, grammar
    or log-probs) proposes up to this many draft tokens copied from its own context and feeds them in the step's
    packed forward; the target's argmax verifies them (output identical to plain greedy), so a row may gain
    several tokens per step. 0: off. Needs packed steps; turns the look-ahead off."""
    prompt_lookup_min: int = 1
    """Shortest n-gram looked up for a draft (``speculative_ngram``)."""
    prompt_lookup_max: int = 3
    """Longest n-gram looked up for a draft, tried first."""
    draft_heads: str = ""
    """Speculation with Medusa draft heads (a directory ``plyx train`` wrote with a ``[draft]`` table, or pass the
    loaded module as ``Engine(draft_heads=...)``): the heads read the target's hidden state of each plain-greedy
    decoding row's last position and their drafts ride in the next step's packed forward, verified by the
    target's argmax (output identical to plain greedy); sampled rows speculate with chains under the rejection
    rule (their law is the model's). "": off. Needs packed steps; excludes
    ``speculative_ngram``; turns the look-ahead and multi-step decode off."""
    speculative_k: int = 0
    """Draft tokens per row and step with ``draft_heads`` (the tree's depth); 0, or more than the heads' count:
    one per head (Medusa head j drafts depth j). At most 16."""
    spec_tree: int = 0
    """Tree verification with ``draft_heads``: each head's top ``spec_tree`` candidates form a token tree (the
    rank paths whose ranks sum to at most ``spec_tree - 1``; Medusa's tree attention) verified in one packed
    forward, the longest accepted path kept. 0 or 1: a chain (each head's argmax). At most 8."""

    look_ahead: bool | None = None
    """When every running sequence sampled this step and none waits, queue the next step's forward (each row fed
    the token just chosen, on the device) before reading the tokens on the host, so the device computes step
    N + 1 while the host handles step N (``generate``'s look-ahead). A row that turns out finished wasted one
    token of that forward. None: on where the device runs asynchronously (CUDA), off on CPU (the forward runs
    inline there, so it would only add the finished rows' work)."""
    guardrails: bool = True
    """Run the safety hooks (``plyx_on_request_received``, ``plyx_output_filters``, ``plyx_on_response``) at the
    engine boundary for requests queued without a ``RequestGuard`` (library users of ``Engine.generate`` and
    ``add_request``); a server passes its own guard per API call. False: a process whose requests were guarded
    upstream (a disaggregated prefill worker)."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: ``auto`` (the model's dtype), ``bf16``, or quantised with per-token, per-head scales
    (about half the memory per token of bf16): ``int8`` (any device) or ``fp8_e4m3`` (Hopper GPUs, CPU)."""

    cuda_graphs: bool = True
    """On a CUDA device, replay decode steps as CUDA graphs (one per batch-size bucket, captured on first
    use); prefill chunks then run in their own forward (``mixed_chunk`` is ignored). No effect on CPU."""

    mixed_graphs: bool | None = None
    """Run packed steps that carry a prefill chunk (mixed steps) as CUDA graphs, one per token-count bucket
    (``plyx.serve.engine.MixedGraphs``), all captured when the engine starts. None: on where ``cuda_graphs`` and
    packed steps are on and the device is CUDA. True on CPU runs the same bucketed static step eagerly (what
    the tests compare with the unpadded packed step). False: packed steps run eagerly."""
    decode_steps: int | None = None
    """Decode steps per schedule when the step is decode-only and no request waits (multi-step decode): the
    engine runs this many one-token steps back to back, each fed the previous step's tokens on the device, and
    reads the tokens once (plain-greedy batches on CUDA: one graph replay of all of them, as ``generate``).
    A step's host work (scheduling, inputs, the token read-back) is then paid once per block instead of once per
    token, which is what bounds a GPU decode step at serving batch sizes. Rows needing per-token host logic
    (grammar, stop strings, log-probs, penalties, custom processors, adapters) keep one step per schedule; a row
    finishing inside a block keeps exactly the tokens one step at a time would give (the rest is discarded).
    The cost: a request arriving mid-block waits for the block's end (at most ``decode_steps - 1`` steps) and
    tokens are streamed in bursts. None: 16 on CUDA (``DEFAULT_CUDA_DECODE_STEPS``), 1 elsewhere (on CPU the
    forward, not the host, dominates).
    Values are used rounded down to a power of two, at most 32."""
    stream_interval: int = 0
    """Tokens per streamed event of a multi-step block (vLLM's ``stream_interval``). 0 (the default): a row's
    tokens of one block in one event (its text in one delta): they reach the host together anyway, so this
    costs no latency, and the engine and the server's event loop handle up to ``decode_steps`` times fewer
    events (H100, 32 x 512 decode-heavy: 0.67 -> 0.78 of ``generate``'s tok/s). 1: every token its own event
    (and SSE chunk), as a one-step engine streams; k > 1: events of up to k tokens. Single steps always emit
    one token per event."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "block_size", "max_queue"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"EngineConfig.{name}", f"{name} must be >= 1", value=value,
                                  fix=f"pass a positive {name}")
        from plyx.attn import PAGED_MAX_QUERY

        if not 0 <= self.mixed_chunk <= PAGED_MAX_QUERY:
            raise ConfigError("EngineConfig.mixed_chunk", f"mixed_chunk must be in [0, {PAGED_MAX_QUERY}]",
                              value=self.mixed_chunk, fix=f"use 0 (off) or up to {PAGED_MAX_QUERY}")
        if not 0 <= self.speculative_ngram <= 16:
            raise ConfigError("EngineConfig.speculative_ngram", "speculative_ngram must be in [0, 16]",
                              value=self.speculative_ngram, fix="use 0 (off) or a few draft tokens, e.g. 4")
        if not 0 <= self.speculative_k <= 16:
            raise ConfigError("EngineConfig.speculative_k", "speculative_k must be in [0, 16]", value=self.speculative_k,
                              fix="use 0 (the heads' count) or a few draft tokens, e.g. 4")
        if not 0 <= self.spec_tree <= 8:
            raise ConfigError("EngineConfig.spec_tree", "spec_tree must be in [0, 8]", value=self.spec_tree,
                              fix="use 0 (chain verification) or a few candidates per head, e.g. 2 or 3")
        if self.draft_heads and self.speculative_ngram:
            raise ConfigError("EngineConfig.draft_heads", "draft heads and prompt-lookup speculation both propose "
                              "drafts; the engine runs one proposer", value=self.draft_heads,
                              fix="set speculative_ngram=0 or leave draft_heads empty")
        if self.decode_steps is not None and not 1 <= self.decode_steps <= 32:
            raise ConfigError("EngineConfig.decode_steps", "decode_steps must be in [1, 32]", value=self.decode_steps,
                              fix="use 1 (one step per schedule), e.g. 8, or None for the device's default")
        if self.stream_interval < 0:
            raise ConfigError("EngineConfig.stream_interval", "stream_interval must be >= 0",
                              value=self.stream_interval,
                              fix="use 0 (a block's tokens in one event), 1 (every token its own event) or e.g. 8")
        from plyx.serve._ngram import check_lookup

        check_lookup(self.prompt_lookup_min, self.prompt_lookup_max)
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"EngineConfig.{name}", f"{name} must be >= 0", value=value,
                                  fix="use 0 for the default")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("EngineConfig.kv_cache_dtype", f"unknown KV-cache dtype {self.kv_cache_dtype!r}",
                              value=self.kv_cache_dtype, fix=f"use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.max_batch_tokens < self.max_batch_size:
            raise ConfigError("EngineConfig.max_batch_tokens",
                              f"max_batch_tokens must be >= max_batch_size ({self.max_batch_size}) so a full "
                              "decode step fits", value=self.max_batch_tokens,
                              fix="raise max_batch_tokens or lower max_batch_size")

    def paged_cache(self, layout: Any) -> Any:
        """The engine's paged KV cache for ``layout`` (a ``CacheLayout`` in the model's dtype), as
        ``kv_cache_dtype`` says: ``plyx.attn.PagedKVCache`` or ``plyx.attn.QuantizedPagedKVCache``.
        A dtype the device does not support is a ``ConfigError`` naming the fix."""
        import attrs
        from plyx.attn import PagedKVCache, QuantizedPagedKVCache

        if self.kv_cache_dtype in ("auto", "bf16"):
            return PagedKVCache(layout if self.kv_cache_dtype == "auto" else attrs.evolve(layout, dtype="bfloat16"))
        try:
            return QuantizedPagedKVCache(layout, kv_dtype=self.kv_cache_dtype)
        except ValueError as exc:
            raise ConfigError("EngineConfig.kv_cache_dtype", str(exc), value=self.kv_cache_dtype,
                              fix="set it (plyx serve: --kv-cache-dtype) to a dtype this device runs") from None
