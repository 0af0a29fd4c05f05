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
        raise TypeError("build a MultiLoraLinear with MultiLoraLinear.wrap(linear, n_adapters, batch)")

    @classmethod
    def wrap(cls, linear: nn.Linear, n_adapters: int, batch: AdapterBatch) -> MultiLoraLinear:
        """Adopt ``linear``'s own ``weight`` and ``bias`` Parameters; ``n_adapters`` adapters of rank 0 so far
        (adapters resident before this layer was first targeted leave it alone)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        w = linear.weight
        self.register_buffer("A", w.new_zeros(n_adapters, 0, self.in_features), persistent=False)
        self.register_buffer("B", w.new_zeros(n_adapters, self.out_features, 0), persistent=False)
        self.batch = batch
        return self

    @torch.no_grad()
    def append(self, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Stack one more adapter: ``a [r, in]``, ``b [out, r]`` (scaling folded in), or None (not targeted)."""
        r = 0 if a is None else a.shape[0]
        rank = max(self.A.shape[1], r)
        A = F.pad(self.A, (0, 0, 0, rank - self.A.shape[1]))  # [n, rank, in]: zero rows add nothing
        B = F.pad(self.B, (0, rank - self.B.shape[2]))  # [n, out, rank]
        new_a = self.A.new_zeros(1, rank, self.in_features)
        new_b = self.B.new_zeros(1, self.out_features, rank)
        if a is not None and b is not None:
            new_a[0, :r] = a
            new_b[0, :, :r] = b
        self.A, self.B = torch.cat([A, new_a]), torch.cat([B, new_b])

    @torch.no_grad()
    def drop(self, i: int) -> None:
        """Remove the ``i``-th stacked adapter."""
        self.A = torch.cat([self.A[:i], self.A[i + 1:]])
        self.B = torch.cat([self.B[:i], self.B[i + 1:]])

    @property
    def weight_is_effective(self) -> bool:
        """The weight alone is the output while no row of the batch is adapted (fused paths may read it)."""
        return self.batch.rows is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        rows = self.batch.rows
        if rows is None or self.A.shape[1] == 0:
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


def _shadow(model: nn.Module) -> nn.Module:
    """A module tree with the model's linears at the same paths, sharing their ``weight``/``bias`` Parameters
    (nothing copied): plyx-model's ``load_peft`` checks and loads an adapter onto it, the model untouched."""
    root = nn.Module()
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = mod.in_features, mod.out_features
        lin.weight, lin.bias = mod.weight, mod.bias
        parent = root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, lin)
    return root


class MultiLora:
    """The adapters resident on a served model, by name; ``activate(names)`` sets a forward's rows.

    Build with ``MultiLora.load(model, {"name": "path/to/peft_dir", ...})``; ``add`` and ``remove`` change
    the set later (call them between forwards: the server runs them on the engine thread).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: list[str] = []
        self.paths: dict[str, str] = {}
        self.index: dict[str, int] = {}
        self.batch = AdapterBatch()

    @classmethod
    def load(cls, model: nn.Module, adapters: dict[str, str | os.PathLike[str]]) -> MultiLora:
        """Load every PEFT adapter directory onto ``model`` (its targeted linears become ``MultiLoraLinear``).

        Raises:
            ConfigError: see ``add``.
        """
        if not adapters:
            raise ConfigError("lora", "no adapters given", fix="pass --lora NAME=PATH at least once")
        multi = cls(model)
        for name, path in adapters.items():
            multi.add(name, path)
        return multi

    def add(self, name: str, path: str | os.PathLike[str]) -> None:
        """Make the PEFT adapter at ``path`` resident as ``name``. On an error nothing changes.

        Raises:
            ConfigError: naming ``--lora NAME=PATH``: a name in use, not an adapter directory, an adapter trained
                on another base (tensor shapes, with the adapter's rank and target modules), target modules the
                base lacks, an unbatchable variant (DoRA).
        """
        from plyx.model.adapters import AdapterError, AdapterMismatchError, adapter_config, adapter_layers, load_peft

        where = f"--lora {name}={path}"
        if name in self.index:
            raise ConfigError(where, f"an adapter named {name!r} is resident already", value=name,
                              fix="unload it first or pick another name")
        shadow = _shadow(self.model)
        try:
            load_peft(shadow, path, name=name)
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
        variant = adapter_config(shadow, name).variant
        if variant not in _BATCHABLE:
            raise ConfigError(where, f"the adapter's variant {variant!r} cannot be batched with others "
                              f"(only {', '.join(_BATCHABLE)} are)", value=variant,
                              fix="merge it into the base (merge_and_unload) and serve that model")
        layers = adapter_layers(shadow)
        n = len(self.names)
        for path_ in layers:  # first time a linear is targeted: it starts batching adapters
            module = self.model.get_submodule(path_)
            if not isinstance(module, MultiLoraLinear):
                parent, _, attr = path_.rpartition(".")
                setattr(self.model.get_submodule(parent) if parent else self.model, attr,
                        MultiLoraLinear.wrap(module, n, self.batch))
        for path_, module in self.model.named_modules():
            if isinstance(module, MultiLoraLinear):
                layer = layers.get(path_)
                if layer is None:
                    module.append(None, None)
                else:
                    module.append(layer.lora_A[name].weight, layer.lora_B[name].weight * layer.scaling[name])
        self.names.append(name)
        self.paths[name] = str(path)
        self.index = {n_: i for i, n_ in enumerate(self.names)}

    def remove(self, name: str) -> None:
        """Unload adapter ``name`` (no request may be running on it)."""
        if name not in self.index:
            raise ConfigError("lora_name", f"adapter {name!r} is not resident (adapters: "
                              f"{', '.join(self.names) or 'none'})", value=name, fix="name a loaded adapter")
        i = self.index[name]
        for module in self.model.modules():
            if isinstance(module, MultiLoraLinear):
                module.drop(i)
        self.names.pop(i)
        del self.paths[name]
        self.index = {n_: j for j, n_ in enumerate(self.names)}

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
