"""Triton-kernel prefill microservice: model, engine and HTTP API."""
