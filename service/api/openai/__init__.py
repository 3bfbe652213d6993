"""OpenAI's API as vLLM serves it (completions, chat, models, tokenizer); its pooling routes
(/v1/embeddings and the rest) live in service/api/retrieval/."""

from service.api.openai import chat, completions, models, tokenizer

ROUTERS = (models.router, completions.router, chat.router, tokenizer.router)
