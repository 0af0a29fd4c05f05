"""plyx-dist: data, fully sharded and tensor parallel training for plyx-train on torch.distributed.

Installed, it answers plyx-train's ``plyx_train_strategy`` hook in every rank of a run launched
by ``plyx train CONFIG --nproc N`` or ``torchrun ... -m plyx.specs train CONFIG``; the
``[dist]`` table of the ``TrainConfig`` picks DDP, FSDP2, HSDP or FSDP + TP.
"""

from typing import Any

__all__ = ["DistStrategy", "Plan", "RankFailure", "consolidate", "plan"]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.dist`` (and so its plugin entry point, ``plyx.dist._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.dist._exports``.
    """
    if name in __all__:
        from plyx.dist import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
