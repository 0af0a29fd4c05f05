"""Prompt-lookup (n-gram) drafts: speculation with no draft model (Saxena 2023, "prompt lookup decoding";
vLLM's ``ngram`` method).

The last n tokens of a sequence (prompt + generated) are looked up earlier in the same sequence; the k
tokens that followed the most recent match are the draft. Outputs that copy from their context (code
edits, extraction, summaries quoting the source, retrieval answers) accept long runs; elsewhere no match
is found and the step is a plain decode step. The draft is deterministic, so as a proposal distribution
it is one-hot: rejection sampling accepts d with probability p(d) and resamples from p with d removed,
which keeps every emitted token distributed as the target's (greedy: accept iff d is the argmax).
"""

from __future__ import annotations

from collections.abc import Sequence

from plyx.specs.errors import ConfigError

__all__ = ["check_lookup", "propose"]


def check_lookup(min_n: int, max_n: int) -> None:
    """``1 <= prompt_lookup_min <= prompt_lookup_max <= 16``, else a ConfigError naming the field."""
    for name, value in (("prompt_lookup_min", min_n), ("prompt_lookup_max", max_n)):
        if not (isinstance(value, int) and 1 <= value <= 16):
            raise ConfigError(name, f"{name} must be an int in [1, 16]", value=value, fix="use e.g. 1 and 3")
    if min_n > max_n:
        raise ConfigError("prompt_lookup_min", f"prompt_lookup_min ({min_n}) exceeds prompt_lookup_max ({max_n})",
                          value=min_n, fix="make prompt_lookup_min <= prompt_lookup_max")


def propose(seq: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``seq``: what followed the most recent earlier occurrence of its last n
    tokens, for the largest n in ``[min_n, max_n]`` that occurs; empty when none does.

    Args:
        seq: the sequence so far (prompt + generated tokens).
        k: most tokens to propose.
        min_n, max_n: n-gram sizes tried, longest first (a longer match is the better predictor).

    Returns:
        The draft (0 to k token ids).

    Example:
        >>> propose([5, 6, 7, 8, 5, 6], k=2, min_n=1, max_n=3)
        [7, 8]
    """
    length = len(seq)
    if k <= 0:
        return []
    seq = list(seq)  # slicing a list is the fast path for the comparisons below
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = seq[length - n:]
        first = pattern[0]
        # most recent start i < length - n whose n tokens equal the pattern (the suffix itself excluded)
        for i in range(length - n - 1, -1, -1):
            if seq[i] == first and seq[i:i + n] == pattern:
                return seq[i + n:i + n + k]
    return []
