"""Checkpoints: plyx's own layout (safetensors shards + index + ``ModelCard``) and Hugging Face directories.

A plyx checkpoint directory::

    model_card.json                     ModelCard v2: config, tensors, sha256 and size of each shard
    model.safetensors.index.json        {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    model-00001-of-0000N.safetensors    the tensors, plyx names

Writes go to a temporary sibling directory renamed into place (atomic).
Loads check every shard's size against its header and the card, and its
sha256 against the card, before any tensor is used. A Hugging Face directory
(``config.json`` + ``*.safetensors``, sharded or not) opens through the same
``Checkpoint`` protocol with ``card.layout == "hf"``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from plyx.model._errors import CheckpointError, CheckpointIntegrityError, CheckpointMismatchError
from plyx.model._hf_config import IGNORED_HF_TENSORS, config_from_hf, config_to_hf, hf_name, plyx_name
from plyx.model._hf_moe import MOE_ARCHITECTURES, Composite, fold_experts, unfold_experts
from plyx.model._model import TransformerLM, torch_dtype
from plyx.model._safetensors_io import atomic_directory, canonical_dtype, check_complete, read_header, sha256_file
from plyx.specs.checkpoint import CARD_FILE, INDEX_FILE, ModelCard, TensorEntry
from plyx.specs.config.model import ModelConfig
from plyx.specs.errors import ConfigError
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "CheckpointDir",
    "load_checkpoint",
    "load_hf",
    "open_checkpoint",
    "save_checkpoint",
    "save_hf",
]

#: largest shard written (bytes); a tensor bigger than this gets a shard of its own
DEFAULT_SHARD_BYTES = 2 << 30
HF_SINGLE_FILE = "model.safetensors"


class CheckpointDir:
    """An opened checkpoint directory (plyx or Hugging Face layout); satisfies ``plyx.specs.Checkpoint``.

    Tensor names are always plyx's (``layers.0.mlp.up_proj.weight``), whatever the layout on disk.
    """

    def __init__(self, path: Path, card: ModelCard, weight_map: dict[str, str], disk_names: dict[str, str],
                 composites: dict[str, Composite] | None = None) -> None:
        self._path = path
        self._card = card
        self._weight_map = weight_map  # plyx name -> shard file
        self._disk = disk_names  # plyx name -> name inside the shard
        self._composites = composites or {}  # plyx name -> the checkpoint tensors it is stacked from (HF experts)
        self._verified = False

    @property
    def path(self) -> Path:
        return self._path

    @property
    def card(self) -> ModelCard:
        return self._card

    @property
    def config(self) -> ModelConfig:
        return self._card.model

    def tensor_names(self) -> list[str]:
        return list(self._weight_map)

    def shards(self) -> list[str]:
        return sorted(set(self._weight_map.values()).union(*(c.shards() for c in self._composites.values())))

    def load_tensor(self, name: str, device: str = "cpu") -> torch.Tensor:
        return self.load_tensors([name], device=device)[name]

    def load_tensors(self, names: Iterable[str], device: str = "cpu") -> dict[str, torch.Tensor]:
        """Read ``names``, opening each shard once and closing it after (memory maps are released)."""
        names = list(names)
        composite = [n for n in names if n in self._composites]
        if composite:
            return {**self.load_tensors([n for n in names if n not in self._composites], device=device),
                    **self._load_composites(composite, device)}
        by_shard: dict[str, list[str]] = {}
        for name in names:
            if name not in self._weight_map:
                raise KeyError(f"tensor {name!r} is not in checkpoint {self._path} ({len(self._weight_map)} tensors)")
            by_shard.setdefault(self._weight_map[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, group in by_shard.items():
            try:
                with safe_open(str(self._path / shard), framework="pt", device=str(device)) as f:
                    for name in group:
                        out[name] = f.get_tensor(self._disk[name])
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                check_complete(self._path / shard)
                raise CheckpointIntegrityError(shard, f"cannot be read: {exc}") from None
        return out

    def _load_composites(self, names: list[str], device: str) -> dict[str, torch.Tensor]:
        """Stacked expert tensors, each read from its per-expert parts (one shard open per shard)."""
        by_shard: dict[str, set[str]] = {}
        for name in names:
            for group in self._composites[name].parts:
                for shard, disk in group:
                    by_shard.setdefault(shard, set()).add(disk)
        out: dict[str, torch.Tensor] = {}
        for name in names:  # one layer's parts at a time: the per-expert copies never all live at once
            parts = {disk for group in self._composites[name].parts for _, disk in group}
            read: dict[str, torch.Tensor] = {}
            for shard, disks in by_shard.items():
                wanted = disks & parts
                if wanted:
                    with safe_open(str(self._path / shard), framework="pt", device=str(device)) as f:
                        read.update({d: f.get_tensor(d) for d in wanted})
            out[name] = self._composites[name].build(read)
        return out

    def load_state_dict(self, device: str = "cpu") -> Mapping[str, torch.Tensor]:
        return self.load_tensors(self.tensor_names(), device=device)

    def verify(self) -> None:
        """Check each shard's size (header, and the card when it records sizes) and sha256 (when recorded)."""
        for shard in self.shards():
            path = self._path / shard
            if not path.exists():
                raise CheckpointError(f"shard {shard!r} listed by {self._path} is missing; restore it")
            want_size = self._card.shard_bytes.get(shard)
            size = path.stat().st_size
            if want_size is not None and size != want_size:
                what = "is truncated" if size < want_size else "changed size"
                raise CheckpointIntegrityError(shard, f"{what}: {size} bytes on disk, the card says {want_size}",
                                               expected=want_size, found=size)
            check_complete(path)
            want = self._card.shards.get(shard)
            if want is not None:
                got = sha256_file(path)
                if got != want:
                    raise CheckpointIntegrityError(shard, f"has sha256 {got[:16]}..., the card says {want[:16]}...",
                                                   expected=want, found=got)
        self._verified = True

    def __repr__(self) -> str:
        return f"CheckpointDir({str(self._path)!r}, layout={self._card.layout}, tensors={len(self._weight_map)})"


# -- opening ---------------------------------------------------------------------------
def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointDir:
    """Open a plyx (``model_card.json``) or Hugging Face (``config.json``) checkpoint directory.

    Nothing is verified or loaded yet; see ``CheckpointDir.verify``.
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} is not a directory; pass the directory holding the shards")
    if (p / CARD_FILE).exists():
        return _open_plyx(p)
    if (p / "config.json").exists():
        return _open_hf(p)
    raise CheckpointError(
        f"{str(p)!r} holds neither {CARD_FILE} (a plyx checkpoint) nor config.json (a Hugging Face model); "
        f"point at the directory save_checkpoint() or save_pretrained() wrote"
    )


def _open_plyx(p: Path) -> CheckpointDir:
    try:
        doc = json.loads((p / CARD_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{p / CARD_FILE} is not valid JSON ({exc}); restore it from the source") from None
    try:
        card = ModelCard.from_dict(doc, source=str(p / CARD_FILE))
    except ConfigError as exc:
        raise CheckpointError(f"{p / CARD_FILE}: {exc}") from exc
    if card.layout == "hf":
        names = {plyx_name(n): n for n in card.tensors}
        wmap = {plyx_name(n): e.shard for n, e in card.tensors.items()}
    else:
        names = {n: n for n in card.tensors}
        wmap = {n: e.shard for n, e in card.tensors.items()}
    return CheckpointDir(p, card, wmap, names)


def _open_hf(p: Path) -> CheckpointDir:
    try:
        hf = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{p / 'config.json'} is not valid JSON ({exc})") from None
    config = config_from_hf(hf, source=str(p / "config.json"))
    index = p / INDEX_FILE
    if index.exists():
        shard_of = dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        shards = sorted(set(shard_of.values()))
    else:
        shards = sorted(f.name for f in p.glob("*.safetensors"))
        if not shards:
            bins = sorted(f.name for f in p.glob("*.bin")) + sorted(f.name for f in p.glob("*.pt"))
            hint = (f" (found {', '.join(bins[:3])}: pickle files, which plyx never loads; convert them with "
                    f"transformers' save_pretrained(safe_serialization=True))") if bins else ""
            raise CheckpointError(f"{p} has config.json but no *.safetensors weights{hint}")
        shard_of = {}
    tensors: dict[str, TensorEntry] = {}
    for shard in shards:
        header = read_header(p / shard)
        for name, meta in header.items():
            if name.startswith("__") or name.endswith(IGNORED_HF_TENSORS):
                continue
            if shard_of and shard_of.get(name) not in (None, shard):
                continue
            tensors[name] = TensorEntry(shard=shard, shape=list(meta["shape"]), dtype=canonical_dtype(meta["dtype"]))
    composites: dict[str, Composite] = {}
    renamed: dict[str, str] = {}
    if hf.get("model_type") in MOE_ARCHITECTURES:  # per-expert tensors on disk, stacked in plyx
        tensors, composites, renamed = fold_experts(config, hf["model_type"], tensors, source=str(p))
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters store the tied copy too
    dtypes = {e.dtype for e in tensors.values()}
    card = ModelCard(
        name=hf.get("_name_or_path") or p.name,
        model=config,
        layout="hf",
        dtype=dtypes.pop() if len(dtypes) == 1 else config.dtype,
        tensors=tensors,
        num_params=sum(_numel(e.shape) for e in tensors.values()),
    )
    names = {plyx_name(n): renamed.get(n, n) for n in tensors}
    wmap = {plyx_name(n): e.shard for n, e in tensors.items()}
    return CheckpointDir(p, card, wmap, names, {plyx_name(n): c for n, c in composites.items()})


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- loading ---------------------------------------------------------------------------
def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a model of ``config`` has, with its shape (no memory: built on ``meta``)."""
    model = TransformerLM(config, device="meta")
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def check_tensors(ckpt: CheckpointDir, config: ModelConfig) -> None:
    """Raise ``CheckpointMismatchError`` listing every missing, unexpected or mis-shaped tensor."""
    want = expected_shapes(config)
    have = {plyx_name(n) if ckpt.card.layout == "hf" else n: tuple(e.shape) for n, e in ckpt.card.tensors.items()}
    problems = []
    for name, shape in want.items():
        if name not in have:
            problems.append(f"missing tensor {name!r} (model expects shape {list(shape)})")
        elif have[name] != shape:
            problems.append(f"tensor {name!r}: checkpoint shape {list(have[name])} vs model shape {list(shape)}")
    for name in have:
        if name not in want:
            problems.append(f"unexpected tensor {name!r} with shape {list(have[name])} (the model has no such parameter)")
    if problems:
        raise CheckpointMismatchError(problems, source=str(ckpt.path))


def load_checkpoint(
    path: str | os.PathLike[str] | CheckpointDir,
    *,
    device: Any = "cpu",
    dtype: Any = None,
    config: ModelConfig | None = None,
    verify: bool = True,
) -> TransformerLM:
    """Build the ``TransformerLM`` of a plyx or Hugging Face checkpoint and load its weights.

    Args:
        path: the checkpoint directory (or an opened ``CheckpointDir``).
        device: where the parameters go.
        dtype: parameter dtype (``"bfloat16"``, ``torch.float32``...); default: the stored one.
        config: use this architecture instead of the card's (shapes are checked against it).
        verify: check sizes and sha256 digests first (``CheckpointIntegrityError`` names the shard).

    Example::

        model = load_checkpoint("runs/step-1000", device="cuda", dtype="bfloat16")
    """
    ckpt = path if isinstance(path, CheckpointDir) else open_checkpoint(path)
    config = config or ckpt.config
    if dtype is not None:
        config = config.replace(dtype=str(torch_dtype(dtype)).removeprefix("torch."))
    elif ckpt.card.dtype in ("float32", "bfloat16", "float16") and ckpt.card.dtype != config.dtype:
        config = config.replace(dtype=ckpt.card.dtype)
    check_tensors(ckpt, config)
    if verify:
        ckpt.verify()
    model = TransformerLM(config, device="meta")
    target = torch_dtype(config.dtype)
    state = {n: t.to(device=device, dtype=target) for n, t in ckpt.load_state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_hf(path: str | os.PathLike[str], *, device: Any = "cpu", dtype: Any = None) -> TransformerLM:
    """Load a Hugging Face model directory (Llama, Qwen2, Qwen3, Mistral; safetensors only)."""
    ckpt = open_checkpoint(path)
    if ckpt.card.layout != "hf":
        raise CheckpointError(f"{path} is a plyx checkpoint, not a Hugging Face directory; use load_checkpoint()")
    return load_checkpoint(ckpt, device=device, dtype=dtype)


# -- saving ----------------------------------------------------------------------------
def _plan_shards(state: Mapping[str, torch.Tensor], max_bytes: int, stem: str) -> dict[str, list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {f"{stem}.safetensors": groups[0]}
    return {f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _write_shards(out: Path, state: Mapping[str, torch.Tensor], max_bytes: int, stem: str) -> dict[str, str]:
    weight_map: dict[str, str] = {}
    for shard, names in _plan_shards(state, max_bytes, stem).items():
        # contiguous CPU copies: safetensors stores raw bytes and refuses shared storage
        tensors = {n: state[n].detach().to("cpu").contiguous().clone() for n in names}
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def _producers() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("plyx-specs", "plyx-kernel", "plyx-attn", "plyx-model"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def save_checkpoint(
    model: TransformerLM,
    path: str | os.PathLike[str],
    *,
    card_fields: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``model`` as a plyx checkpoint directory, atomically; returns the path.

    Args:
        model: the model (its ``config`` goes into the card).
        path: the directory to create or replace.
        card_fields: extra ``ModelCard`` fields (``name``, ``training``, ``license``, ``tokenizer``...).
        max_shard_bytes: split the tensors into shards of at most this size.

    Example::

        save_checkpoint(model, "runs/step-1000", card_fields={"name": "tiny-llama", "training": {"steps": 1000}})
    """
    state = model.state_dict()
    extra = dict(card_fields or {})
    for reserved in ("model", "tensors", "shards", "shard_bytes", "layout", "version"):
        if reserved in extra:
            raise ValueError(f"card_fields may not set {reserved!r}: save_checkpoint() writes it from the model")
    dest = Path(path)
    with atomic_directory(dest) as tmp:
        weight_map = _write_shards(tmp, state, max_shard_bytes, "model")
        shards = sorted(set(weight_map.values()))
        tensors = {n: TensorEntry(shard=weight_map[n], shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                   for n, t in state.items()}
        card = ModelCard.from_dict({
            "name": extra.pop("name", "plyx-model"),
            "model": model.config.to_dict(),
            "layout": "plyx",
            "dtype": model.config.dtype,
            "tensors": {n: {"shard": e.shard, "shape": e.shape, "dtype": e.dtype} for n, e in tensors.items()},
            "shards": {s: sha256_file(tmp / s) for s in shards},
            "shard_bytes": {s: (tmp / s).stat().st_size for s in shards},
            "num_params": model.num_params(),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "producers": {**_producers(), **extra.pop("producers", {})},
            **extra,
        })
        (tmp / CARD_FILE).write_text(json.dumps(card.to_dict(), indent=2) + "\n", encoding="utf-8")
    return dest


def save_hf(model: TransformerLM, path: str | os.PathLike[str], *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``model`` as a Hugging Face directory that ``transformers`` loads (``from_pretrained``).

    ``config.json`` + ``model.safetensors`` (or shards + ``model.safetensors.index.json``),
    Hugging Face tensor names; a tied LM head is not stored twice.
    """
    from plyx.model.adapters import adapter_layers

    if adapter_layers(model):  # transformers would drop the adapter tensors and load the bare base
        raise CheckpointError(
            "save_hf: the model carries adapters; merge_and_unload(model) first for a merged checkpoint, or "
            "save_hf a model without them and save_peft(model, dir) for the adapter alone"
        )
    hf_config = config_to_hf(model.config)
    state = {hf_name(n): t for n, t in model.state_dict().items()}
    if model.config.moe is not None:
        state = unfold_experts(model.config, state)  # one tensor per expert and projection, as transformers writes
    dest = Path(path)
    with atomic_directory(dest) as tmp:
        weight_map = _write_shards(tmp, state, max_shard_bytes, "model")
        if len(set(weight_map.values())) == 1:
            (tmp / INDEX_FILE).unlink()  # a single file needs no index (transformers' own convention)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    return dest
