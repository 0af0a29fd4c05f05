"""The plyx kernel registry and its kernels: reference PyTorch and Triton implementations with gradients."""

__all__: list[str] = []
