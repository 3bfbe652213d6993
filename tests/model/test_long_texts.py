"""Long texts and id lists in pieces (service.model.text_pieces): every way of tokenizing a
text a piece or a tail at a time gives exactly the whole text's tokens, on pathological texts,
for each GGUF pre-tokenizer; decoding in pieces gives the whole text."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, normalizers

from service.model import text_pieces
from service.model.files import default_model_path, gguf_metadata, read_gguf
from service.model.text_pieces import RunTooLong
from service.model.tokenizer import TextTokenizer, cuts_exact, tokenizer_from_gguf

PARTS = ["a", "bc", " ", "  ", "   ", "\n", "\r\n", "\t", "é", "e\u0301", "日本語", "。", "、", ",",
         ".", "!?", "'s", "'ll", "'", "1", "234", "5678", "<|im_start|>", "<|im_end|>", "<|im_",
         "🦙", "👩🏽‍💻", "x_y", "—", "\u00a0", "\x04", "Straße", "ΑΒΓ", "(", ")", "{\"k\": 1}"]


# runs of more than RUN_CHARS (400 under small_pieces) with no space or punctuation to cut at
LONG_RUNS = ["ab" * 700, " " * 900 + "x", "1" * 900, "x" * 50 + " " * 700 + "y",
             "a" + "\u0301" * 800]


def texts(n: int, seed: int) -> list[str]:
    """Random texts of PARTS, long runs, and texts cut at every word or sentence."""
    rng = random.Random(seed)
    out = ["".join(rng.choice(PARTS) for _ in range(rng.randrange(1, 1500))) for _ in range(n)]
    return out + LONG_RUNS + ["word. " * 300, "日本語のテキスト。" * 150]


@pytest.fixture(scope="module")
def meta():
    return gguf_metadata(read_gguf(default_model_path()))


@pytest.fixture(scope="module")
def smollm(meta) -> TextTokenizer:
    return tokenizer_from_gguf(meta, "test")


@pytest.fixture(scope="module", params=["smollm", "gpt2", "llama3", "qwen2"])
def tok(request, meta) -> TextTokenizer:
    """The default model's vocabulary under each GGUF pre-tokenizer."""
    return tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": request.param}, "test")


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces and runs small enough that the texts above are cut many times."""
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 64)
    monkeypatch.setattr(text_pieces, "RUN_CHARS", 400)
    monkeypatch.setattr(text_pieces, "PIECE_IDS", 16)
    monkeypatch.setattr("service.model.tokenizer.PIECE_CHARS", 64)
    monkeypatch.setattr("service.model.tokenizer.RUN_CHARS", 400)


def whole(tok: TextTokenizer, text: str, add_special: bool) -> list[int]:
    bos = [tok.bos_id] if add_special and tok.add_bos else []
    return bos + tok.tok.encode(text, add_special_tokens=False).ids


def test_the_gguf_splits_cut_exactly(tok) -> None:
    assert tok.splittable and tok.max_token_bytes == 162


@pytest.mark.parametrize("add_bos", [False, True])
def test_pieces_and_tails_are_the_whole_texts_tokens(tok, small_pieces, add_bos) -> None:
    tok.add_bos = add_bos
    try:
        for text in texts(16, seed=7 + add_bos):
            for add_special in (True, False):
                want = whole(tok, text, add_special)
                if text in LONG_RUNS:  # refused, not guessed at
                    for encode in (tok.encode_all, lambda t, a: tok.encode_tail(t, 1, a)):
                        with pytest.raises(RunTooLong):
                            encode(text, add_special)
                    continue
                assert tok.encode_all(text, add_special).tolist() == want, text
                for keep in (1, 7, 100, 5000):
                    assert tok.encode_tail(text, keep, add_special) == want[-keep:], (keep, text)
                assert tok.encode_within(text, 10**6, add_special) == want
                for limit in (len(want) - 1, len(want) // 3):  # None, or all (then refused)
                    assert tok.encode_within(text, limit, add_special) in (None, want)
    finally:
        tok.add_bos = False


def test_a_tail_of_a_tokenizer_that_cannot_be_cut_is_checked(meta) -> None:
    """Lowercasing is no normalizer text_pieces knows: tails are checked against a longer one
    (a tail's start may change its first tokens), and a long run is refused, not guessed."""
    tok = tokenizer_from_gguf(meta, "test")
    tok.tok.normalizer = normalizers.Lowercase()
    tok = TextTokenizer(tok.tok, tok.bos_id, tok.eos_id)
    assert not tok.splittable and tok.max_token_bytes is None
    for text in texts(10, seed=3):
        for keep in (1, 9, 300):
            assert tok.encode_tail(text, keep) == whole(tok, text, True)[-keep:]
    with pytest.raises(RunTooLong):
        tok.encode_all("a " * (text_pieces.RUN_CHARS // 2 + 1))


def spec(tok: TextTokenizer) -> dict:
    return json.loads(tok.tok.to_str())


@pytest.mark.parametrize("change", [
    lambda s: s.update(normalizer={"type": "Lowercase"}),
    lambda s: s["pre_tokenizer"]["pretokenizers"][-1].update(add_prefix_space=True),
    lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                      "prepend_scheme": "first", "split": True}),
    lambda s: s["pre_tokenizer"]["pretokenizers"][1]["pattern"].update(Regex=r"\S+\s*"),
    lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(behavior="MergedWithNext"),
    lambda s: s["added_tokens"][0].update(rstrip=True),
    lambda s: s.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False,
                                      "trim_offsets": False, "use_regex": False}),
], ids=["lowercase", "prefix-space", "metaspace", "other-split", "merged-split", "rstrip-token",
        "no-split"])
def test_other_tokenizers_are_not_cut(smollm, change) -> None:
    s = spec(smollm)
    assert cuts_exact(s)
    change(s)
    assert not cuts_exact(s)
    assert not TextTokenizer(Tokenizer.from_str(json.dumps(s)), None, None).splittable


def test_an_over_long_text_is_refused_by_its_bytes_alone(tok) -> None:
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"tokenized: {name}")

    text = "x " * (1000 * 162 // 2 + 1)  # more bytes than 1000 tokens of 162 bytes cover
    real, tok.tok = tok.tok, Untouchable()
    try:
        assert tok.encode_within(text, 1000) is None
    finally:
        tok.tok = real
    # a character no token spells (BPE drops it) counts for nothing: those texts are counted
    assert tok.encode_within("\x04" * (162 * 1000 + 1), 1000) == []


def test_decoding_in_pieces_is_the_whole_text(tok, small_pieces) -> None:
    rng = np.random.default_rng(0)
    for text in texts(10, seed=11):
        ids = np.asarray(tok.encode(text), np.int64)
        assert "".join(tok.decode_pieces(ids)) == tok.decode(ids.tolist()) == tok.tok.decode(
            ids.tolist(), skip_special_tokens=False)
    # byte tokens that split characters, and ids that are no UTF-8 at all
    ids = rng.integers(0, tok.vocab_size, 3000)
    assert "".join(tok.decode_pieces(ids)) == tok.tok.decode(ids.tolist(),
                                                              skip_special_tokens=False)
