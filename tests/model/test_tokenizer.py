"""Our GGUF tokenizer against transformers' GGUF tokenizer on the embedded default model."""

from __future__ import annotations

import pytest

from service.model.files import default_model_path, gguf_metadata, read_gguf
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


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_within_a_limit_is_encode_for_long_texts(toks, name):
    """Counting a long text piece by piece never refuses one within the limit: at the exact
    token count it returns `encode`'s ids, one token less and it refuses."""
    from service.model.tokenizer import PIECE_CHARS

    ours, _ = toks
    text = (TEXTS[name] + " ") * (3 * PIECE_CHARS // len(TEXTS[name]))  # three pieces or more
    assert len(text) > 2 * PIECE_CHARS
    ids = ours.encode(text)
    assert ours.encode_within(text, len(ids)) == ids
    assert ours.encode_within(text, len(ids) + 1000) == ids
    assert ours.encode_within(text, len(ids) // 2) is None


def test_encode_within_stops_counting_early(toks, monkeypatch):
    from service.model.tokenizer import PIECE_CHARS

    ours, _ = toks
    seen: list[int] = []
    real = ours.tok.encode
    monkeypatch.setattr(ours, "tok", type("T", (), {"encode": staticmethod(
        lambda text, **kw: seen.append(len(text)) or real(text, **kw))})())
    assert ours.encode_within("7" * 5_000_000, 8192) is None  # one token per digit
    assert sum(seen) <= PIECE_CHARS


def test_gguf_special_tokens_and_chat_template_match_transformers(toks) -> None:
    ours, ref = toks
    assert ours.token_str(ours.bos_id) == ref.bos_token
    assert ours.token_str(ours.eos_id) == ref.eos_token
    assert ours.token_str(ours.pad_id) == ref.pad_token
    assert ours.chat_template == ref.chat_template and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("where", ["string", "named", "jinja file", "none"])
def test_hf_chat_template_and_pad_token(tmp_path, where) -> None:
    """The template transformers would use: chat_template.jinja first, then tokenizer_config's
    string or its "default" named template; pad from the config's token name."""
    import json

    from service.model.tokenizer import load_hf_tokenizer
    from tests.model.checkpoints import write_tokenizer

    write_tokenizer(tmp_path, 300)
    tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tc: dict = {"pad_token": {"content": "</s>"}, "add_bos_token": True}
    if where == "string":
        tc["chat_template"] = tpl
    elif where == "named":
        tc["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": tpl}]
    elif where == "jinja file":
        (tmp_path / "chat_template.jinja").write_text(tpl)
        tc["chat_template"] = "not this one"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = load_hf_tokenizer(tmp_path, {"bos_token_id": 0, "eos_token_id": [1, 5]})
    assert tok.chat_template == (None if where == "none" else tpl)
    assert tok.token_str(tok.pad_id) == "</s>" and tok.add_bos and tok.eos_id == 1
