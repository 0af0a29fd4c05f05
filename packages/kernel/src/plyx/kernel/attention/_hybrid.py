"""``attention`` implementation ``hybrid``: torch SDPA where it is the library's fast case, the Triton flash kernel elsewhere.

The rule, per call (``sdpa_suits``): plain causal self-attention (``causal=True``, ``T == S``, no mask, no
packed documents, no window, no lse asked) goes to ``attention_sdpa`` (``is_causal=True``, GQA through
``enable_gqa``: cuDNN or flash attention on CUDA, with their own saved-lse backward); everything else
(packed documents, windows, masks, ``return_lse``) goes to the Triton flash kernel, which handles those
without a dense ``[T, S]`` mask. Measured on an H100 (torch 2.11, 2026-11-24, 1B Llama shape, 3 training
steps): cuDNN SDPA 12.8 + 43.1 ms forward + backward against the Triton kernel's 14.4 + 53.2 ms.

It is never the registry's default (priority 5): the training step names it (``plyx.kernel.training_kernels``,
``TrainConfig.attention``). ``ROUTES`` counts the eager calls each side took (under ``torch.compile`` the
same rule is applied when the graph is traced: ``plyx.kernel._custom_ops``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["ROUTES", "attention_hybrid", "sdpa_suits"]

#: "sdpa" / "triton" -> eager calls routed there (not counted while Dynamo traces: no side effect in a graph)
ROUTES: Counter[str] = Counter()


def sdpa_suits(q: torch.Tensor, k: torch.Tensor, *, causal: bool, mask: torch.Tensor | None,
               document_ids: torch.Tensor | None, window: int | None, return_lse: bool = False) -> bool:
    """Whether an ``attention`` call is plain causal self-attention (SDPA's ``is_causal`` case, no mask built).

    Args:
        q, k: ``[B, T, H, Dh]`` and ``[B, S, KV, Dh]``; the other arguments as ``attention``'s.

    Returns:
        True when SDPA runs it as one ``is_causal`` call (its top-left alignment is the contract's when T == S).
    """
    return (causal and mask is None and document_ids is None and window is None and not return_lse
            and q.shape[1] == k.shape[1])


def attention_hybrid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                     scale: float | None = None, mask: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None, window: int | None = None,
                     return_lse: bool = False) -> Any:
    """The ``attention`` contract: SDPA for plain causal calls, the Triton flash kernel for the rest."""
    from plyx.kernel.attention import attention_sdpa, attention_triton

    if sdpa_suits(q, k, causal=causal, mask=mask, document_ids=document_ids, window=window, return_lse=return_lse):
        if not torch.compiler.is_compiling():
            ROUTES["sdpa"] += 1
        return attention_sdpa(q, k, v, causal=causal, scale=scale)
    if not torch.compiler.is_compiling():
        ROUTES["triton"] += 1
    return attention_triton(q, k, v, causal=causal, scale=scale, mask=mask, document_ids=document_ids,
                            window=window, return_lse=return_lse)
