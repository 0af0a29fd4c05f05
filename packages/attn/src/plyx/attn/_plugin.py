"""The built-in plugin of plyx-attn, registered under the `plyx` entry-point group."""

from __future__ import annotations

plyx_contracts = {"hooks": "1.0"}
