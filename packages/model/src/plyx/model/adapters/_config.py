"""``LoraConfig``: what one adapter is (rank, scale, dropout, target modules, variant)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from plyx.model.adapters._errors import AdapterError

__all__ = ["LoraConfig", "matches_target"]

#: characters that make a target a regular expression (as PEFT treats a pattern string)
_REGEX_CHARS = re.compile(r"[\\^$.*+?()\[\]{}|]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """One low-rank adapter: ``y = W x + scaling * B(A(dropout(x)))`` on each targeted linear.

    Example::

        add_adapter(model, LoraConfig(r=16, alpha=32, target_modules=("q_proj", "v_proj")))
    """

    r: int = 8
    """Rank of ``A [r, in]`` and ``B [out, r]``; > 0."""
    alpha: float = 16
    """Scale numerator: ``scaling = alpha / r`` (lora, dora) or ``alpha / sqrt(r)`` (rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in train mode, in [0, 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Linears to adapt. A plain name matches the last component(s) of the module path or of its Hugging Face
    name (``q_proj``, ``mlp.up_proj``, ``model.layers.0.mlp.up_proj``); ``re:<pattern>`` or a name with regex characters must fullmatch the module path
    (``layers.0.self_attn.q_proj``) or its Hugging Face name (``model.layers.0.self_attn.q_proj``), as in PEFT."""
    variant: str = "lora"
    """lora | rslora | dora, or a variant a plugin adds through the ``plyx_adapter_variants`` hook."""
    lora_plus_ratio: float | None = None
    """LoRA+ (Hayou et al. 2024): learning rate of B = ratio * learning rate of A (``lora_plus_param_groups``)."""
    init_lora_weights: bool = True
    """True: A Kaiming-uniform, B zero (the adapted model starts equal to the base). False: both random
    (tests, or an init done by the caller)."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):  # one pattern given bare: keep it whole, not its characters
            object.__setattr__(self, "target_modules", (self.target_modules,))
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise AdapterError(f"LoraConfig.r must be a positive int (got {self.r!r}); a rank of 8 to 64 is usual")
        if not self.alpha > 0:
            raise AdapterError(f"LoraConfig.alpha must be > 0 (got {self.alpha!r}); alpha = 2 * r is a common choice")
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterError(f"LoraConfig.dropout must be in [0, 1) (got {self.dropout!r})")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise AdapterError(
                f"LoraConfig.target_modules must be non-empty names or patterns (got {self.target_modules!r}); "
                f"e.g. ('q_proj', 'v_proj') or ('re:layers\\.[01]\\..*_proj',)"
            )
        for t in self.target_modules:
            pattern = _pattern(t)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise AdapterError(f"LoraConfig.target_modules: {t!r} is not a valid regex ({exc})") from None
        if self.lora_plus_ratio is not None and not self.lora_plus_ratio > 0:
            raise AdapterError(
                f"LoraConfig.lora_plus_ratio must be > 0 or None (got {self.lora_plus_ratio!r}); the LoRA+ paper uses 16"
            )


def _pattern(target: str) -> str | None:
    """The regex of a target (None: a plain name)."""
    if target.startswith("re:"):
        return target[3:]
    # a dotted path of plain names (``mlp.up_proj``) is a suffix, not a regex
    if _REGEX_CHARS.search(target.replace(".", "")):
        return target
    return None


def matches_target(path: str, targets: Sequence[str]) -> bool:
    """Whether the module at ``path`` (plyx name) is one of ``targets`` (see ``LoraConfig.target_modules``)."""
    names = (path, f"model.{path}")  # plyx's path and the Hugging Face one (what PEFT configs name)
    for t in targets:
        pattern = _pattern(t)
        if pattern is None:
            if any(n == t or n.endswith("." + t) for n in names):
                return True
        elif any(re.fullmatch(pattern, n) for n in names):
            return True
    return False
