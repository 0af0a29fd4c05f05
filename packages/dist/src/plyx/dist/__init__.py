"""plyx-dist: data, fully sharded and tensor parallel training for plyx-train on torch.distributed.

Installed, it answers plyx-train's ``plyx_train_strategy`` hook in every rank of a run launched
by ``plyx train CONFIG --nproc N`` or ``torchrun ... -m plyx.specs train CONFIG``; the
``[dist]`` table of the ``TrainConfig`` picks DDP, FSDP2, HSDP or FSDP + TP.
"""

from plyx.dist._checkpoint import consolidate
from plyx.dist._plan import Plan, plan
from plyx.dist._strategy import DistStrategy, RankFailure

__all__ = ["DistStrategy", "Plan", "RankFailure", "consolidate", "plan"]
