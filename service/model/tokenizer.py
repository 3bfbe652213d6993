"""Tokenizers: a HF `tokenizer.json`, or byte-level BPE rebuilt from GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from service.model.errors import ModelLoadError

# GPT-2's split, used by llama.cpp's "smollm" (digits isolated first) and "gpt2" pre-tokenizers
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE = {  # tokenizer.ggml.pre -> (isolate single digits first, split regex)
    "smollm": (True, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "default": (False, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
_CONTROL = 3  # llama.cpp token type for control tokens such as <|im_start|>
_USER_DEFINED = 4  # added tokens that are not special (Qwen3's <think>): matched whole too
PIECE_CHARS = 1 << 15  # characters per piece when counting the tokens of a long text
PIECE_SLACK = 8  # tokens a piece's count may exceed its share of the whole text's


def _piece_end(text: str, start: int) -> int:
    """End of the piece from `start`: before a space after a non-space, near PIECE_CHARS on."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    cut = text.rfind(" ", end - 1024, end)
    while cut > start and text[cut - 1].isspace():
        cut = text.rfind(" ", end - 1024, cut)
    return cut if cut > start else end


class TextTokenizer:
    """`chat_template`: the model's own Jinja template (tokenizer_config.json, or the GGUF's
    `tokenizer.chat_template`), None when it has none."""

    def __init__(self, tok: Tokenizer, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False, pad_id: int | None = None,
                 chat_template: str | None = None):
        self.tok = tok
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.pad_id, self.chat_template = pad_id, chat_template

    def token_str(self, token_id: int | None) -> str | None:
        """The vocabulary entry of a special token (`<|im_end|>`), None for None."""
        return None if token_id is None else self.tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """`add_special`: the BOS the model's tokenizer adds (vLLM's `add_special_tokens`)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_within(self, text: str, limit: int, add_special: bool = True
                      ) -> list[int] | None:
        """`encode(text)`, or None after about `limit` tokens of work once it surely has more."""
        if len(text) > PIECE_CHARS:
            counted = pieces = start = 0
            while start < len(text):
                end = _piece_end(text, start)
                counted += len(self.tok.encode(text[start:end], add_special_tokens=False))
                pieces += 1
                if counted > limit + PIECE_SLACK * pieces:
                    return None
                start = end
        return self.encode(text, add_special)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


def load_hf_tokenizer(model_dir: Path, cfg: dict[str, Any] | None = None) -> TextTokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing tokenizer file (tokenizer.json is required)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ModelLoadError(f"{path}: cannot parse tokenizer: {e}") from e
    cfg = cfg or {}
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    # encode() skips the post-processor's BOS; add it when the tokenizer config asks for it
    tc = _json(model_dir / "tokenizer_config.json")
    pad = cfg.get("pad_token_id")
    if pad is None and (name := _token_name(tc.get("pad_token"))) is not None:
        pad = tok.token_to_id(name)
    return TextTokenizer(tok, cfg.get("bos_token_id"), eos,
                         add_bos=bool(tc.get("add_bos_token", False)), pad_id=pad,
                         chat_template=_hf_chat_template(model_dir, tc))


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot parse: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_name(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(model_dir: Path, tc: dict[str, Any]) -> str | None:
    """transformers' order: chat_template.jinja beside the tokenizer, then tokenizer_config's
    `chat_template` (a string, or named templates of which "default" is used)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = tc.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_from_gguf(meta: dict[str, Any], where: str) -> TextTokenizer:
    """Byte-level BPE from `tokenizer.ggml.{model,pre,tokens,token_type,merges,bos/eos}`."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{where}: tokenizer model {kind!r} not supported (supported: gpt2)")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise ModelLoadError(f"{where}: missing tokenizer metadata {key!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    vocab = {}
    for i, t in enumerate(tokens):  # control tokens may use characters outside the byte alphabet
        vocab[t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())] = i
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    digits, split = _GGUF_PRE.get(meta.get("tokenizer.ggml.pre", "default"), _GGUF_PRE["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and set(t) <= alphabet]
    if user:
        tok.add_tokens(user)
    return TextTokenizer(tok, meta.get("tokenizer.ggml.bos_token_id"),
                         meta.get("tokenizer.ggml.eos_token_id"),
                         add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                         pad_id=meta.get("tokenizer.ggml.padding_token_id"),
                         chat_template=meta.get("tokenizer.chat_template"))
