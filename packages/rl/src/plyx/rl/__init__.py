"""Preference and RL training for plyx."""

__all__: list[str] = []
