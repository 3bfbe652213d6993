"""Tokenizers: a HF `tokenizer.json`, or byte-level BPE rebuilt from GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from service.model.errors import ModelLoadError
from service.model.text_pieces import (
    PIECE_CHARS,
    RUN_CHARS,
    RunTooLong,
    id_pieces,
    tail_starts,
    text_pieces,
)

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
PIECE_SLACK = 8  # tokens a piece's count may exceed its share of the whole text's
TAIL_CHARS = 4  # characters per kept token of the first tail that truncation tokenizes
_SPLITS = {_GPT2_SPLIT, _LLAMA3_SPLIT, _QWEN2_SPLIT}


def cuts_exact(spec: dict[str, Any]) -> bool:
    """Whether text_pieces' cuts keep a tokenizer.json exact (BPE, ByteLevel, our splits)."""
    norm = spec.get("normalizer") or {"normalizers": []}
    pre = spec.get("pre_tokenizer") or {}
    *first, last = pre.get("pretokenizers", [pre])

    def split(step: dict) -> bool:
        return (step.get("type") == "Split" and step.get("behavior") == "Isolated"
                and step.get("pattern", {}).get("Regex") in _SPLITS and not step.get("invert"))

    return (spec.get("model", {}).get("type") == "BPE"
            and all(n.get("type") in ("NFC", "NFD", "NFKC", "NFKD")
                    for n in norm.get("normalizers", [norm]))
            and last.get("type") == "ByteLevel" and not last.get("add_prefix_space")
            and all(s.get("type") == "Digits" or split(s) for s in first)
            and (last.get("use_regex") or any(map(split, first)))
            and not any(t.get(k) for t in spec.get("added_tokens", ())
                        for k in ("lstrip", "rstrip", "single_word")))


class TextTokenizer:
    """`chat_template`: the model's own Jinja template or None; long texts go in pieces."""

    def __init__(self, tok: Tokenizer, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False, pad_id: int | None = None,
                 chat_template: str | None = None):
        self.tok = tok
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.pad_id, self.chat_template = pad_id, chat_template
        spec = json.loads(tok.to_str())
        self.splittable = cuts_exact(spec)
        self._added = [t["content"] for t in spec.get("added_tokens", ())]
        vocab = tok.get_vocab(with_added_tokens=True)
        # byte-level BPE without a normalizer: a token spells at most max_token_bytes of text
        self._coverage = _coverage(vocab) if self.splittable and spec.get(
            "normalizer") is None else None
        self.max_token_bytes = max(len(t.encode()) for t in vocab) if self._coverage else None

    def token_str(self, token_id: int | None) -> str | None:
        """The vocabulary entry of a special token (`<|im_end|>`), None for None."""
        return None if token_id is None else self.tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def _ids(self, text: str) -> list[int]:
        # NOTE: encode_batch_fast, not encode: it releases the GIL (and skips the offsets)
        return self.tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def _bos(self, add_special: bool) -> list[int]:
        """`add_special`: the BOS the model's tokenizer adds (vLLM's `add_special_tokens`)."""
        return [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []

    def _pieces(self, text: str) -> Iterator[str]:
        if self.splittable:
            return text_pieces(text, self._added)
        if len(text) > RUN_CHARS:
            raise RunTooLong(f"this model's tokenizer takes a text in one piece, and this one "
                             f"has more than {RUN_CHARS} characters")
        return iter([text])

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self._bos(add_special) + self._ids(text)

    def encode_all(self, text: str, add_special: bool = True) -> np.ndarray:
        """encode(text) as int32, a piece at a time."""
        return np.concatenate([np.array(self._bos(add_special), np.int32)] + [
            np.array(self._ids(p), np.int32) for p in self._pieces(text)])

    def encode_within(self, text: str, limit: int, add_special: bool = True
                      ) -> list[int] | None:
        """`encode(text)`, or None once it surely has more than `limit` tokens."""
        if self._surely_over(text, limit):
            return None
        if self.splittable or len(text) > PIECE_CHARS:
            ids: list[int] = []
            for k, piece in enumerate(text_pieces(text, self._added, self.splittable)):
                if len(ids) > limit + (0 if self.splittable else PIECE_SLACK * k):
                    return None
                ids += self._ids(piece)
            if self.splittable:
                return self._bos(add_special) + ids
        return self.encode(text, add_special)

    def _surely_over(self, text: str, limit: int) -> bool:
        """Whether `text` has more bytes than `limit` tokens spell."""
        if self._coverage is None or self.max_token_bytes is None:
            return False
        dropped, share = self._coverage
        most, lost = limit * self.max_token_bytes, sum(text.count(c) for c in dropped if c in text)
        return len(text) - lost > most or not text.isascii() and share * len(
            text.encode("utf-8", "surrogatepass")) - lost > most

    def encode_tail(self, text: str, keep: int, add_special: bool = True) -> list[int]:
        """encode(text)[-keep:], from tails that grow until two end in the same `keep` tokens."""
        last = None
        for start in tail_starts(text, TAIL_CHARS * keep + 64, self._added):
            if start == 0:
                return self.encode_all(text, add_special)[-keep:].tolist()
            ids = np.concatenate([np.array(self._ids(p), np.int32)
                                  for p in self._pieces(text[start:])])
            if len(ids) >= keep:
                if last is not None and np.array_equal(ids[-keep:], last[-keep:]):
                    return ids[-keep:].tolist()
                last = ids
        raise AssertionError("tail_starts ends with the whole text")

    def special_ends(self) -> tuple[list[int], list[int]]:
        """The post-processor's tokens before and after a text (Qwen3-Embedding's <|endoftext|>)."""
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        i = next((i for i in range(len(full)) if full[i:i + len(plain)] == plain), None)
        if i is None:
            return [], []
        return full[:i], full[i + len(plain):]

    def encode_pair(self, a: str, b: str) -> list[int]:
        """A text pair as the post-processor's pair template joins it (cross-encoders)."""
        return self.tok.encode(a, b, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        # NOTE: decode_batch, not decode: it releases the GIL
        return self.tok.decode_batch([list(ids)], skip_special_tokens=skip_special)[0]

    def decode_pieces(self, ids: np.ndarray) -> Iterator[str]:
        """decode(ids), a piece at a time."""
        for piece in id_pieces(ids, self.decode):
            yield self.decode(piece.tolist())

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
    """transformers' order: chat_template.jinja, then tokenizer_config's (or its "default")."""
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


def _coverage(vocab: dict[str, int]) -> tuple[str, float] | None:
    """ASCII characters BPE drops and the least share of a longer one's bytes it keeps; None if
    it drops a continuation byte."""
    dropped, share = "", 1.0
    for b, ch in _bytes_to_unicode().items():
        if ch in vocab or b in (0xC0, 0xC1) or b >= 0xF5:  # the last: never in UTF-8
            continue
        if 0x80 <= b < 0xC0:
            return None
        if b < 0x80:
            dropped += chr(b)
        else:  # the lead byte of n: the other n - 1 are spelled
            n = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            share = min(share, (n - 1) / n)
    return dropped, share


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
