"""Retrieval routes (DESIGN.md): embeddings now; rerank, classify and TEI's join a module each."""

from service.api.retrieval import embeddings

ROUTERS = (embeddings.router,)
