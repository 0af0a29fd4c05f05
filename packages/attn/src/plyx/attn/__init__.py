"""Attention modules and KV caches (contiguous and paged with prefix sharing) for plyx."""

__all__: list[str] = []
