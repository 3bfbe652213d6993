"""A TextTokenizer as a Hugging Face tokenizer directory that AutoTokenizer loads to encode as
the service does; `tokenizer_config` is also GET /tokenizer_info's answer, as vLLM's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from service.model.tokenizer import TextTokenizer

# transformers' class for a bare tokenizer.json; the rules live in the files, not in a subclass
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_SPECIAL = ("bos_token", "eos_token", "pad_token")


def _special_tokens(tok: TextTokenizer) -> dict[str, str | None]:
    return dict(zip(_SPECIAL, map(tok.token_str, (tok.bos_id, tok.eos_id, tok.pad_id))))


def tokenizer_config(tok: TextTokenizer, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS rule, longest input, chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": TOKENIZER_CLASS,
        **_special_tokens(tok),
        "add_bos_token": bool(tok.add_bos and tok.bos_id is not None),
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # decode() gives the text back as it was
    }
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    return config


def special_tokens_map(tok: TextTokenizer) -> dict[str, str]:
    return {k: v for k, v in _special_tokens(tok).items() if v is not None}


def tokenizer_json(tok: TextTokenizer) -> str:
    """tokenizer.json whose post-processor adds what `tok.encode` adds: the BOS, or nothing."""
    out = Tokenizer.from_str(tok.tok.to_str())
    bos = tok.token_str(tok.bos_id)
    want = [tok.bos_id] if tok.add_bos and bos is not None else []
    if out.encode("", add_special_tokens=True).ids != want:
        out.post_processor = TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.bos_id)]) if want else None
    return out.to_str(pretty=True)


def export_tokenizer(tok: TextTokenizer, out_dir: Path, model_max_length: int) -> list[Path]:
    """Write the three files into `out_dir` (created if missing); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json(tok),
        "tokenizer_config.json": json.dumps(tokenizer_config(tok, model_max_length), indent=2,
                                            ensure_ascii=False),
        "special_tokens_map.json": json.dumps(special_tokens_map(tok), indent=2,
                                              ensure_ascii=False),
    }
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
        written.append(path)
    return written
