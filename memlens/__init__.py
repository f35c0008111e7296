"""memlens: predict, measure and explain the GPU memory of PyTorch training."""
__all__: list[str] = []
