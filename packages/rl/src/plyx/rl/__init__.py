"""plyx-rl: post-training for plyx models: SFT and preference optimisation (DPO family, ORPO, SimPO, KTO)."""

from plyx.rl._losses import (
    DPO_LOSS_TYPES,
    PreferenceLoss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    preference_metrics,
    simpo_loss,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "PreferenceLoss",
    "dpo_loss",
    "kto_loss",
    "orpo_loss",
    "preference_metrics",
    "simpo_loss",
]
