"""`python -m service.tokenizer export DIR`: transformers' AutoTokenizer loads the directory and
encodes, renders chats and names special tokens as the service's tokenizer does."""

from __future__ import annotations

import json

import pytest

from service.model.files import default_model_path, model_tokenizer
from service.model.tokenizer import TextTokenizer
from service.model.tokenizer_export import export_tokenizer
from service.tokenizer import main
from tests.model.test_tokenizer import TEXTS

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye ✌️"}],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("tok")
    assert main(["export", str(out), "--model-path", str(default_model_path())]) == 0
    return out, model_tokenizer(None), transformers.AutoTokenizer.from_pretrained(out)


def test_writes_a_complete_tokenizer_directory(exported) -> None:
    out, ours, _ = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False and config["model_max_length"] == 8192
    assert config["chat_template"] == ours.chat_template
    assert json.loads((out / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_same_ids_as_the_service(exported, name) -> None:
    _, ours, hf = exported
    text = TEXTS[name]
    assert hf(text)["input_ids"] == ours.encode(text)
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, False)
    assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text))


def test_special_tokens_and_length(exported) -> None:
    _, ours, hf = exported
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        ours.bos_id, ours.eos_id, ours.pad_id)
    assert hf.model_max_length == 8192 and len(hf) == ours.vocab_size


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_renders_as_the_gguf(exported, chat, gen) -> None:
    """apply_chat_template on the export equals transformers' own reading of the GGUF's
    template, and its ids are the service's ids of that text."""
    import transformers

    _, ours, hf = exported
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>assistant\n" if gen else "<|im_end|>\n")
    ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == ours.encode(text)


def test_a_bos_adding_tokenizer_keeps_its_bos(exported, tmp_path) -> None:
    """A tokenizer whose encode adds the BOS (add_bos) exports a post-processor that does."""
    import transformers

    _, ours, _ = exported
    bos = TextTokenizer(ours.tok, ours.bos_id, ours.eos_id, add_bos=True, pad_id=ours.pad_id)
    export_tokenizer(bos, tmp_path, 4096)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("Hello, world!", ""):
        assert hf(text)["input_ids"] == bos.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == bos.encode(text, False)
    assert hf.model_max_length == 4096 and hf.chat_template is None


def test_a_bad_model_path_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path / "out"), "--model-path", str(tmp_path / "no")]) == 2
    assert "no such file" in capsys.readouterr().err
