"""Llama-family model in plain PyTorch, its configuration, weight loaders and tokenizers."""
