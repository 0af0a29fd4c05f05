"""Governance artifacts for plyx: SPDX SBOMs, Ed25519/DSSE signatures, reproducibility receipts, lineage, model cards and the verify gate (no torch)."""

__all__: list[str] = []
