"""Policy-as-code guardrails for plyx serving and data, and a red-team suite (no torch)."""

__all__: list[str] = []
