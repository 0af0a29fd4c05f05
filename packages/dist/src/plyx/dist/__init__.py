"""Distributed training for plyx on torch.distributed."""

__all__: list[str] = []
