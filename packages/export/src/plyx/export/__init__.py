"""Model export (ONNX) for plyx."""

__all__: list[str] = []
