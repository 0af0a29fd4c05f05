"""The version of every contract this plyx-specs provides, in one light module.

The plugin loader compares a plugin's ``plyx_contracts`` with these at every
scan (``plyx --help`` included), so reading them must not import the contract
modules themselves (msgspec, the config schemas). Each contract module
re-exports its own as ``CONTRACT_VERSION``; bump a contract's version here.
"""

from __future__ import annotations

__all__ = ["CONTRACT_VERSIONS"]

#: contract name -> MAJOR.MINOR
CONTRACT_VERSIONS: dict[str, str] = {
    "hooks": "1.0",
    "kernels": "1.0",
    "kvcache": "1.0",
    "checkpoint": "1.0",
    "batch": "1.0",
    "tensorspec": "1.0",
    "config": "1.0",
}
