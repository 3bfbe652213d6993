"""MTEB's rerank API wrapper against /v1/rerank on the Qwen3-Reranker-style checkpoint, scoring as
MTEB does with the model card's P(yes) computed in-process through transformers."""

from __future__ import annotations

import pytest

from tests.api.test_embedding_clients import scores
from tests.api.test_rerank import p_yes, reranker  # noqa: F401  (module fixture)
from tests.api.test_tei import serving


def test_mteb_rerank_wrapper_scores_as_transformers(reranker, tmp_path) -> None:  # noqa: F811
    mteb = pytest.importorskip("mteb")
    from mteb.cache import ResultCache
    from mteb.mocks.mock_tasks import MockRerankingTask
    from mteb.models.model_meta import ModelMeta
    from mteb.models.openai_wrappers import OpenAIAPIRerankWrapper

    class Local(OpenAIAPIRerankWrapper):
        """MTEB's rerank wrapper with the HTTP hop replaced by transformers in-process."""

        def __init__(self):  # no server to probe
            self.fps = None
            self.mteb_model_meta = ModelMeta.create_empty(
                overwrites={"name": "rr-local", "modalities": ["text"]})

        def _rerank(self, query, documents, top_k=None):
            return p_yes(documents, query)

    kw = dict(cache=ResultCache(str(tmp_path / "cache")), overwrite_strategy="always",
              show_progress_bar=False, co2_tracker=False)
    with serving(reranker) as url:
        api = OpenAIAPIRerankWrapper(url, reranker.state.model_name, modalities=["text"])
        mteb.evaluate(api, MockRerankingTask(), prediction_folder=tmp_path / "api", **kw)
    mteb.evaluate(Local(), MockRerankingTask(), prediction_folder=tmp_path / "local", **kw)
    got, want = (scores(tmp_path / d) for d in ("api", "local"))
    assert got.keys() == want.keys() and len(got) >= 4
    assert max(abs(got[k] - want[k]) for k in got) <= 1e-4, (got, want)
