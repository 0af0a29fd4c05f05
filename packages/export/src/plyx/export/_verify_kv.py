"""Check the KV-cache graph in onnxruntime: logit parity through prefill and decode, and a greedy decode.

Parity: at each ``[B, T]`` shape the graph runs the first ``T - k`` tokens as a
prefill (empty past) and the last ``k`` one at a time with its own ``present``
fed back as ``past``; the concatenated logits are compared with the torch
model's full forward. With ``B > 1`` the first row is left-padded, so
``attention_mask`` and ``position_ids`` are exercised too (pad positions are
not compared: their logits mean nothing on either side).

Greedy: a prompt is decoded for ``greedy_tokens`` tokens through the graph
(prefill, then one token per step with the cache) and by plyx's model
(argmax of the last logits, one full forward per token); the token ids must be equal.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from plyx.export._deps import require, version_of
from plyx.export._errors import ExportError, ExportVerificationError
from plyx.export._kernels import reference_kernels
from plyx.export._result import GreedyCheck, VerificationReport
from plyx.export._verify import DEFAULT_TOLERANCES, _compare, default_shapes

__all__ = ["DEFAULT_GREEDY_TOKENS", "KVSession", "greedy_torch", "verify_kv"]

DEFAULT_GREEDY_TOKENS = 64
_PROVIDER = "CPUExecutionProvider"
_PAD = 2  # left padding of the first row at B > 1


class KVSession:
    """An onnxruntime session of a KV graph with a greedy loop (also used by the benchmark).

    Args:
        path: the ``model.onnx`` with ``past_key_values.N.*`` inputs.
        session_options: an ``onnxruntime.SessionOptions`` (threads), or None.
    """

    def __init__(self, path: str | os.PathLike[str], session_options: Any = None) -> None:
        ort = require("onnxruntime")
        try:
            self.session = ort.InferenceSession(str(path), sess_options=session_options, providers=[_PROVIDER])
        except Exception as exc:  # onnxruntime raises its own error types
            raise ExportError("verify", f"onnxruntime cannot load {str(path)!r}: {type(exc).__name__}: {exc}",
                              fix="upgrade onnxruntime or export with a lower opset") from exc
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        if not self.past_names:
            raise ExportError("verify", f"{str(path)!r} has no past_key_values inputs",
                              fix="export with --with-kv-cache")
        first = inputs[self.past_names[0]]
        self.kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[3])
        self.past_dtype = np.float16 if "float16" in first.type else np.float32
        self.output_names = [o.name for o in self.session.get_outputs()]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=self.past_dtype) for _ in self.past_names]

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One call: ``ids [B, T]``, ``mask [B, P + T]``, ``positions [B, T]`` -> ``(logits [B, T, V], present)``."""
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        feeds.update(zip(self.past_names, past))
        out = self.session.run(self.output_names, feeds)
        return out[0], out[1:]

    def greedy(self, prompt: Sequence[int], new_tokens: int) -> list[int]:
        """Greedy ids after ``prompt`` (batch 1): one prefill, then one cached step per token."""
        ids = np.asarray([list(prompt)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        logits, past = self.step(ids, np.ones((1, T), np.int64), np.arange(T, dtype=np.int64)[None], self.empty_past(1))
        out: list[int] = []
        for _ in range(new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if len(out) == new_tokens:
                break
            length = T + len(out)
            logits, past = self.step(np.asarray([[token]], np.int64), np.ones((1, length), np.int64),
                                     np.asarray([[length - 1]], np.int64), past)
        return out


def greedy_torch(model: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """plyx's greedy decode of ``prompt`` (one full forward per token, reference kernels).

    Returns:
        the ids and, per step, the margin between the best and second-best logit
        (a small margin is where rounding may flip a token).
    """
    device = next(model.parameters()).device
    seq = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, T)
    out, margins = [], []
    with torch.no_grad(), reference_kernels():
        for _ in range(new_tokens):
            last = model(seq)[0, -1].float()  # (V,)
            top = torch.topk(last, 2).values
            token = int(last.argmax())
            out.append(token)
            margins.append(float(top[0] - top[1]))
            seq = torch.cat((seq, seq.new_tensor([[token]])), dim=1)
    return out, margins


def verify_kv(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int | None = None,
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS,
    raise_on_failure: bool = True,
) -> VerificationReport:
    """Check the KV graph at ``path`` against ``model``: logits through prefill + decode, then a greedy decode.

    Args:
        path: the KV-cache ``model.onnx``.
        model: the ``TransformerLM`` it was exported from.
        shapes: ``[B, T]`` shapes (default: two, ``default_shapes``).
        atol, rtol: logit tolerance (``max|diff| <= atol + rtol * max|logits|``), defaults by dtype.
        seed: seed of the token ids (default: fresh, recorded).
        greedy_tokens: tokens of the greedy comparison (fewer when ``max_seq_len`` is shorter; 0 skips it).
        raise_on_failure: raise ``ExportVerificationError`` when a check fails.

    Returns:
        a ``VerificationReport`` whose ``greedy`` holds the decode comparison.
    """
    config = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float16"])
    atol = default_atol if atol is None else float(atol)
    rtol = default_rtol if rtol is None else float(rtol)
    shapes = tuple(shapes) if shapes is not None else default_shapes(config.max_seq_len)
    seed = secrets.randbits(31) if seed is None else int(seed)
    kv = KVSession(path)
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    checks = []
    try:
        for batch, seq_len in shapes:
            ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)  # (B, T)
            checks.append(_parity(kv, model, ids, atol, rtol))
        greedy = None
        prompt_len = min(5, config.max_seq_len - 1)
        steps = min(greedy_tokens, config.max_seq_len - prompt_len)
        if steps > 0:
            prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=generator).tolist()
            want, margins = greedy_torch(model, prompt, steps)
            got = kv.greedy(prompt, steps)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            greedy = GreedyCheck(prompt=tuple(prompt), tokens=steps, onnx=tuple(got), torch=tuple(want),
                                 first_mismatch=first, min_margin=min(margins))
    finally:
        model.train(was_training)
    report = VerificationReport(runtime=f"onnxruntime {version_of('onnxruntime')} ({_PROVIDER})", dtype=dtype,
                                atol=atol, rtol=rtol, seed=seed, checks=checks, greedy=greedy,
                                graph="kv-cache")
    if raise_on_failure and not report.ok:
        bad = next((c for c in report.checks if not c.passed), None)
        if bad is not None:
            problem = (f"the KV-cache graph disagrees with the torch model at input_ids [{bad.batch}, {bad.seq_len}] "
                       f"(prefill then cached decode steps): max abs error {bad.max_abs_error:.3g} > tolerance "
                       f"{bad.tolerance:.3g} (atol {atol:g} + rtol {rtol:g} * max|logits| {bad.max_abs_logit:.3g}), "
                       f"token ids seed {seed}")
        else:
            g = report.greedy
            assert g is not None and g.first_mismatch is not None
            i = g.first_mismatch
            problem = (f"greedy decode through the KV-cache graph differs from plyx's at new token {i} of {g.tokens}: "
                       f"onnxruntime chose {g.onnx[i]}, plyx {g.torch[i]} (smallest top-2 logit margin "
                       f"{g.min_margin:.3g}), seed {seed}")
        raise ExportVerificationError(problem, report=report,
                                      fix="the export was not kept; a mismatch here is a bug in the exported graph "
                                          "(or, in a large float16 model, rounding: raise --atol/--rtol)")
    return report


def _parity(kv: KVSession, model: torch.nn.Module, ids: torch.Tensor, atol: float, rtol: float) -> Any:
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.long)
    if B > 1 and T > _PAD + 1:
        mask[0, :_PAD] = 0  # left padding on the first row
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # (B, T): each real token's index among its row's
    with torch.no_grad(), reference_kernels():
        want = model(ids, attention_mask=mask).float().cpu()  # (B, T, V)
    decode = min(3, T - 1)
    split = T - decode
    ids_np, mask_np, pos_np = ids.numpy(), mask.numpy(), positions.numpy()
    logits, past = kv.step(ids_np[:, :split], mask_np[:, :split], pos_np[:, :split], kv.empty_past(B))
    pieces = [logits]
    for t in range(split, T):
        logits, past = kv.step(ids_np[:, t:t + 1], mask_np[:, :t + 1], pos_np[:, t:t + 1], past)
        pieces.append(logits)
    got = torch.from_numpy(np.concatenate(pieces, axis=1)).float()  # (B, T, V)
    real = mask.bool()[:, :, None]  # pad positions compared as 0 on both sides (a pad query may be NaN)
    return _compare(B, T, torch.where(real, got, 0.0), torch.where(real, want, 0.0), atol, rtol)
