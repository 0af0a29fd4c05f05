"""Data pipeline, Trainer with exact resume, metrics and the `plyx train` command."""

__all__: list[str] = []
