"""OpenAI's API as vLLM serves it (completions, chat, models, tokenizer); its pooling routes
(/v1/embeddings, /v1/rerank, /classify, /pooling) join here, a module and a line each."""

from service.api.openai import chat, completions, models, tokenizer

ROUTERS = (models.router, completions.router, chat.router, tokenizer.router)
