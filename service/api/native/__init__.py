"""The service's own routes: POST /v1/prefill and SGLang's POST /v1/score."""

from service.api.native import prefill, score

ROUTERS = (prefill.router, score.router)
