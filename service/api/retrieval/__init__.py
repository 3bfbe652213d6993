"""Retrieval routes (DESIGN.md): embeddings now; rerank, classify and TEI's join a module each."""

from service.api.retrieval import classify, embeddings, pair_score, pooling, predict, rerank, tei

ROUTERS = (classify.router, rerank.router, pair_score.router, embeddings.router, tei.router,
           pooling.router, predict.router)
