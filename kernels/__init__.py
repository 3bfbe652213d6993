"""Triton kernels for prefill, each beside its PyTorch reference; import the op modules directly.

Importing this package imports nothing heavy: `kernels.ops` is the entry point the model uses, and
`kernels.<op>` modules hold one kernel, its launcher and its `<op>_ref` each.
"""
