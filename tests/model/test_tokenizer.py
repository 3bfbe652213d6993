"""Our GGUF tokenizer against transformers' GGUF tokenizer on the embedded default model."""

from __future__ import annotations

import pytest

from service.model.loader import default_model_path
from service.model.loader_gguf import gguf_metadata, read_gguf
from service.model.tokenizer import tokenizer_from_gguf

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "whitespace": "  leading spaces,\ttabs\n\nand   runs of spaces  ",
    "unicode": "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, עברית",
    "emoji": "I ❤️ 🦙s 👩🏽‍💻 and 🇫🇷 flags 🎉🎉",
    "code": 'def f(x: int) -> dict[str, int]:\n    return {"x": x ** two, \'y\': [x]}  # ok\n',
    "chat": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "numbers": "In 2024, 12345 tokens cost $3.14; call 555-0199 at 09:30.",
    "contractions": "I'm sure they'll say it's what we'd've done, y'know",
}


@pytest.fixture(scope="module")
def toks():
    import transformers

    path = default_model_path()
    ours = tokenizer_from_gguf(gguf_metadata(read_gguf(path)), str(path))
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, ref


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_same_ids_as_transformers(toks, name):
    ours, ref = toks
    text = TEXTS[name]
    assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decode_round_trips(toks, name):
    ours, _ = toks
    text = TEXTS[name]
    assert ours.decode(ours.encode(text)) == text


def test_special_tokens_stay_whole(toks):
    ours, _ = toks
    ids = ours.encode("<|im_start|>user")
    assert ids[0] == ours.tok.token_to_id("<|im_start|>")
    assert ours.bos_id == 1 and ours.eos_id == 2 and ours.vocab_size == 49152


def test_digits_are_split_like_smollm2(toks):
    # SmolLM2's own tokenizer.json isolates every digit (llama.cpp's "smollm" pre-tokenizer).
    ours, _ = toks
    ids = ours.encode("2024 12345")
    assert [ours.decode([i]) for i in ids] == ["2", "0", "2", "4", " ", "1", "2", "3", "4", "5"]
