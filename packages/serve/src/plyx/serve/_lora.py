"""Multi-LoRA serving: many adapters resident on one base model, a batch mixing them (and the base) per row.

Punica / S-LoRA's scheme: the base weight runs once for the whole batch; each adapted linear adds
``s_a * B_a A_a x`` for the rows of adapter ``a`` through one gathered low-rank matmul over the batch
(``lora_delta``: rows grouped by adapter, each group one ``[rows, in] @ [in, r] @ [r, out]``). The
adapters' ``A`` and ``s * B`` are stacked per layer (zero-padded to the largest rank), so switching
adapters between rows costs nothing and no weight is ever merged.

Adapters load through plyx-model (``plyx.model.adapters.load_peft``: PEFT directories, safetensors
only, shapes checked against the base); then every ``LoraLinear`` is replaced by a ``MultiLoraLinear``
that reads the row -> adapter map of the forward in progress (``AdapterBatch``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from plyx.specs.errors import ConfigError
from torch import nn

__all__ = ["AdapterBatch", "MultiLora", "MultiLoraLinear", "lora_delta"]

#: variants whose update is ``s * B A x`` (DoRA rescales the whole output per adapter: not batched here)
_BATCHABLE = ("lora", "rslora")


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The gathered LoRA update of a mixed batch (reference implementation).

    Args:
        x: ``[N, in]`` rows (tokens) of the batch.
        A: ``[n, r, in]`` stacked down-projections (rank padded with zero rows).
        B: ``[n, out, r]`` stacked up-projections, scaling folded in.
        index: ``[N]`` adapter of each row, ``-1`` for the base (no update).

    Returns:
        ``[N, out]`` in ``x``'s dtype: ``B[index[i]] @ A[index[i]] @ x[i]`` per row, 0 for base rows.
    """
    out = x.new_zeros(x.shape[0], B.shape[1])
    # one segment per adapter present: a host sync for the set of adapters, not per row
    for a in index.unique().tolist():
        if a < 0:
            continue
        rows = (index == a).nonzero()[:, 0]
        xa = x.index_select(0, rows).to(A.dtype)  # [m, in]
        out.index_copy_(0, rows, ((xa @ A[a].T) @ B[a].T).to(out.dtype))  # [m, r] -> [m, out]
    return out


def _delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """plyx-kernel's Triton BGMV on a GPU with Triton (one launch pair, no host sync), else the reference."""
    if x.is_cuda:
        try:
            from plyx.kernel.triton_ops.lora_matmul import lora_matmul
        except ImportError:  # the triton extra is not installed
            return lora_delta(x, A, B, index)
        return lora_matmul(x, A, B, index)
    return lora_delta(x, A, B, index)


def _triton_lora() -> bool:
    try:
        import plyx.kernel.triton_ops.lora_matmul  # noqa: F401
    except ImportError:
        return False
    return True


def _segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               segments: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """``lora_delta`` with the rows of each adapter known up front (``AdapterBatch.segments``): no host sync per
    linear, and a batch of one adapter is two plain matmuls."""
    if len(segments) == 1 and segments[0][1] is None:  # every row uses this adapter
        a = segments[0][0]
        return ((x.to(A.dtype) @ A[a].T) @ B[a].T).to(x.dtype)  # [N, r] -> [N, out]
    out = x.new_zeros(x.shape[0], B.shape[1])
    for a, rows in segments:
        xa = x.index_select(0, rows).to(A.dtype)  # type: ignore[arg-type]
        out.index_copy_(0, rows, ((xa @ A[a].T) @ B[a].T).to(out.dtype))  # type: ignore[arg-type]
    return out


_TRITON: list[bool | None] = [None]  # whether plyx-kernel's Triton LoRA matmul imports (checked once)


class AdapterBatch:
    """The row -> adapter map of the forward in progress, shared by every ``MultiLoraLinear`` of a model.

    ``rows`` is ``[B]`` (adapter index per row, -1 = base) or None when no row of the batch is adapted.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.host: list[int] = []  # the same map on the host
        self._segments: dict[int, list[tuple[int, torch.Tensor | None]]] = {}

    def set(self, host: list[int] | None, device: torch.device) -> None:
        """The next forward's map (None: no row is adapted)."""
        self._segments = {}
        self.host = host or []
        self.rows = None if host is None else torch.tensor(host, device=device)

    def segments(self, tokens_per_row: int) -> list[tuple[int, torch.Tensor | None]]:
        """``(adapter, token indices)`` per adapter present (None: all tokens), built once per forward from the
        host map, shared by every linear."""
        seg = self._segments.get(tokens_per_row)
        if seg is None:
            seg = []
            t = tokens_per_row
            for a in sorted(set(self.host)):
                if a < 0:
                    continue
                rows = [i for i, r in enumerate(self.host) if r == a]
                if len(rows) == len(self.host):
                    seg.append((a, None))
                    continue
                idx = [i * t + j for i in rows for j in range(t)]  # row i's tokens: i*T .. i*T + T - 1
                seg.append((a, torch.tensor(idx, device=self.rows.device)))  # type: ignore[union-attr]
            self._segments[tokens_per_row] = seg
        return seg


class MultiLoraLinear(nn.Linear):
    """A linear with several adapters applied per row: ``W x + b + s_a B_a A_a x`` for the row's adapter ``a``.

    Attributes:
        A: ``[n, r_max, in]`` buffer. B: ``[n, out, r_max]`` buffer (scaling folded in; zeros for adapters
        that do not target this layer). batch: the model's ``AdapterBatch``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("build a MultiLoraLinear with MultiLoraLinear.from_lora(layer, names, batch)")

    @classmethod
    def from_lora(cls, layer: Any, names: Sequence[str], rank: int, batch: AdapterBatch) -> MultiLoraLinear:
        """Adopt a plyx-model ``LoraLinear``'s base Parameters and stack its adapters ``names`` (rank ``rank``)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        w = layer.weight
        A = torch.zeros(len(names), rank, self.in_features, device=w.device, dtype=w.dtype)
        B = torch.zeros(len(names), self.out_features, rank, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for i, name in enumerate(names):
                if name not in layer.variants:
                    continue  # this adapter leaves the layer alone: zeros
                a, b = layer.lora_A[name].weight, layer.lora_B[name].weight  # [r, in], [out, r]
                A[i, : a.shape[0]] = a
                B[i, :, : b.shape[1]] = b * layer.scaling[name]
        self.register_buffer("A", A, persistent=False)
        self.register_buffer("B", B, persistent=False)
        self.batch = batch
        return self

    @property
    def weight_is_effective(self) -> bool:
        """The weight alone is the output while no row of the batch is adapted (fused paths may read it)."""
        return self.batch.rows is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        rows = self.batch.rows
        if rows is None:
            return result
        # x: [B, T, in] (the engine's forwards) or [N, in]; every token of a row uses the row's adapter
        flat = x.reshape(-1, x.shape[-1])  # [B*T, in]
        if flat.shape[0] % rows.shape[0]:
            raise RuntimeError(f"a multi-LoRA forward got {flat.shape[0]} tokens for {rows.shape[0]} rows: the rows "
                               "must be padded to one width (the engine's forwards are)")
        per_row = flat.shape[0] // rows.shape[0]
        if flat.is_cuda and _TRITON[0] is None:
            _TRITON[0] = _triton_lora()
        if flat.is_cuda and _TRITON[0]:
            delta = _delta(flat, self.A, self.B, rows.repeat_interleave(per_row))  # [B*T] adapter per token
        else:
            delta = _segmented(flat, self.A, self.B, self.batch.segments(per_row))
        return result + delta.reshape(result.shape)


class MultiLora:
    """The adapters resident on a served model, by name; ``activate(names)`` sets a forward's rows.

    Build with ``MultiLora.load(model, {"name": "path/to/peft_dir", ...})``.
    """

    def __init__(self, model: nn.Module, names: list[str], paths: dict[str, str], batch: AdapterBatch) -> None:
        self.model = model
        self.names = names
        self.paths = paths
        self.index = {n: i for i, n in enumerate(names)}
        self.batch = batch

    @classmethod
    def load(cls, model: nn.Module, adapters: dict[str, str | os.PathLike[str]]) -> MultiLora:
        """Load every PEFT adapter directory onto ``model`` (in place) and make its linears batch them.

        Raises:
            ConfigError: naming ``--lora NAME=PATH``: not an adapter directory, an adapter trained on another
                base (tensor shapes, with the adapter's rank and target modules), an unbatchable variant.
        """
        from plyx.model.adapters import AdapterError, AdapterMismatchError, adapter_config, adapter_layers, load_peft

        if not adapters:
            raise ConfigError("lora", "no adapters given", fix="pass --lora NAME=PATH at least once")
        for name, path in adapters.items():
            where = f"--lora {name}={path}"
            try:
                load_peft(model, path, name=name)
            except AdapterMismatchError as exc:  # tensors of another shape: another base, or another rank
                raise ConfigError(where, f"the adapter {_peft_summary(path)}does not fit this base model: {exc}",
                                  value=str(path), fix="serve it with the base model it was trained on "
                                  "(same d_model, heads, d_ff and layers, and linears of those names)") from None
            except AdapterError as exc:  # not an adapter directory, or target modules the base does not have
                raise ConfigError(where, f"cannot load the adapter {_peft_summary(path)}onto this base model: {exc}",
                                  value=str(path), fix="point it at a PEFT LoRA directory trained on this base "
                                  "(plyx.model.adapters.save_peft writes one)") from None
            except (OSError, ValueError) as exc:
                raise ConfigError(where, f"not a PEFT LoRA adapter directory: {exc}", value=str(path),
                                  fix="point it at a directory with adapter_config.json and "
                                      "adapter_model.safetensors (plyx.model.adapters.save_peft writes one)") from None
            variant = adapter_config(model, name).variant
            if variant not in _BATCHABLE:
                raise ConfigError(where, f"the adapter's variant {variant!r} cannot be batched with others "
                                  f"(only {', '.join(_BATCHABLE)} are)", value=variant,
                                  fix="merge it into the base (merge_and_unload) and serve that model")
        names = list(adapters)
        rank = max(adapter_config(model, n).r for n in names)
        batch = AdapterBatch()
        for path, layer in adapter_layers(model).items():
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    MultiLoraLinear.from_lora(layer, names, rank, batch))
        model.__dict__.pop("_plyx_adapters", None)  # the plyx-model adapter state no longer describes the modules
        return cls(model, names, {n: str(p) for n, p in adapters.items()}, batch)

    def activate(self, adapters: Sequence[str | None]) -> None:
        """Set the next forward's rows: ``adapters[i]`` is row i's adapter name (None: the base)."""
        if all(a is None for a in adapters):
            self.batch.set(None, torch.device("cpu"))
            return
        device = next(self.model.parameters()).device
        self.batch.set([-1 if a is None else self.index[a] for a in adapters], device)

    def clear(self) -> None:
        self.batch.set(None, torch.device("cpu"))


def _peft_summary(path: str | os.PathLike[str]) -> str:
    """``(r=8, target_modules=[...]) `` of a PEFT directory's config, or empty when unreadable."""
    import json
    from pathlib import Path

    try:
        doc = json.loads((Path(path) / "adapter_config.json").read_text())
        return f"(r={doc.get('r')}, target_modules={doc.get('target_modules')}) "
    except (OSError, ValueError):
        return ""
