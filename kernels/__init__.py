"""Triton kernels for prefill, each beside its PyTorch reference; the model calls `kernels.ops`."""
