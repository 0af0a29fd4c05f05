"""The public names of ``plyx.dist``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.dist.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.dist._checkpoint import consolidate
from plyx.dist._plan import Plan, plan
from plyx.dist._strategy import DistStrategy, RankFailure
