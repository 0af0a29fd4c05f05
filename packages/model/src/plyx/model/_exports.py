"""The public names of ``plyx.model``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.model.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.model._checkpoint import (
    CheckpointDir,
    load_checkpoint,
    load_hf,
    open_checkpoint,
    save_checkpoint,
    save_hf,
)
from plyx.model._draft_heads import (
    DRAFT_KINDS,
    DraftHeadsError,
    EagleDraft,
    MedusaHeads,
    build_draft_heads,
    load_draft_heads,
    save_draft_heads,
)
from plyx.model._errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    UnsupportedArchitectureError,
)
from plyx.model._hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from plyx.model._model import TransformerLM
from plyx.model._moe import ROUTER_METRICS, SparseMoE, load_balancing_loss, router_z_loss
from plyx.model._streaming import LayerStreamer, stream_forward
from plyx.model.adapters import (
    LoraConfig,
    add_adapter,
    disable_adapters,
    load_peft,
    merge_and_unload,
    neftune,
    save_peft,
    set_adapter,
)
