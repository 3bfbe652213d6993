"""Parity with Hugging Face transformers (fp32, same weights) as the reference implementation."""

from __future__ import annotations

import pytest
import torch

from service.model.files import default_model_path
from service.model.loader import load_model
from tests.model.checkpoints import GEMMA3_WINDOW, write_checkpoint
from tests.model.prefill import Prefiller

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    import transformers

    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                            shards=3 if request.param == "qwen2" else 1)
    ours = load_model(path, "cpu", torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, ref


def _hf_last_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1].float()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.isfinite(a).all()
    diff = (a - b).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.3g} > {ATOL}"
    assert a.argmax().item() == b.argmax().item()


def test_tiny_single_and_batch_match_transformers(tiny):
    ours, ref = tiny
    prompts = _prompts(ours.cfg.vocab_size, [1, 9, 33, 70], seed=1)
    pre = Prefiller(ours.model)
    solo = [pre.last_logits([p])[0] for p in prompts]
    for p, s in zip(prompts, solo):
        _close(s, _hf_last_logits(ref, p))
    together = Prefiller(ours.model).last_logits(prompts)
    for s, t in zip(solo, together):
        _close(t, s)


def test_tiny_uses_config_features(tiny):
    ours, _ = tiny
    cfg = ours.cfg
    if cfg.arch == "llama":
        assert cfg.rope_scaling and cfg.rope_scaling["factor"] == 8.0
        assert not cfg.tie_word_embeddings and ours.model.lm_head is not None
    elif cfg.arch == "qwen2":
        assert cfg.qkv_bias and ours.model.layers[0].qkv_proj.bias is not None
        assert cfg.tie_word_embeddings and ours.model.lm_head is None
    elif cfg.arch == "qwen3":
        assert cfg.qk_norm and not cfg.qkv_bias and not cfg.windows
        assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (64, 4, 32)  # 4 x 32 != 64
        assert cfg.tie_word_embeddings and ours.model.lm_head is None
    else:
        assert cfg.arch == "gemma3"
        assert cfg.windows == (GEMMA3_WINDOW, GEMMA3_WINDOW, 0) * 2
        assert cfg.qk_norm and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
        assert cfg.embed_scale == 8.0 and cfg.head_dim == 32
        assert cfg.attn_scale == pytest.approx(24**-0.5)
        assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
        assert cfg.final_logit_softcap == 30.0
        assert cfg.tie_word_embeddings and ours.model.lm_head is None


def test_chunked_prefix_reuse_matches_one_pass(tiny):
    ours, _ = tiny
    (prompt,) = _prompts(ours.cfg.vocab_size, [61], seed=2)
    pre = Prefiller(ours.model, page_size=4)
    one = pre.last_logits([prompt])[0]
    # 23 is not a page multiple: the second chunk starts mid-page.
    first = pre.chunk(prompt[:23])
    pre.run([first])
    second = pre.chunk(prompt[23:], prefix_len=23, pages=list(first.pages))
    two = pre.run([second])[0][-1]
    _close(two, one)


@pytest.mark.parametrize("tiny", ["gemma3"], indirect=True)
def test_window_chunks_read_the_paged_prefix(tiny):
    """Chunk boundaries inside the sliding window and across it, each chunk reading the keys
    before it from the paged cache, give the one-pass logits at every position."""
    ours, ref = tiny
    assert ours.cfg.num_windowed_layers == 4
    (prompt,) = _prompts(ours.cfg.vocab_size, [41], seed=5)
    pre = Prefiller(ours.model, page_size=4)
    one = pre.run([pre.chunk(prompt, all_logits=True)])[0]
    with torch.no_grad():
        assert (one - ref(torch.tensor([prompt])).logits[0].float()).abs().max() <= ATOL
    # chunks of 5, 8 (the window), 9, 15 and 4 tokens, mid-page: windows across a boundary, or not
    cuts = [0, 5, 13, 22, 37, len(prompt)]
    pages: list[int] = []
    rows = []
    for s, e in zip(cuts, cuts[1:]):
        c = pre.chunk(prompt[s:e], prefix_len=s, pages=pages, all_logits=True)
        pages = list(c.pages)
        rows.append(pre.run([c])[0])
    two = torch.cat(rows)
    assert two.shape == one.shape
    diff = (two - one).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.3g} > {ATOL}"


def test_prompt_logits_for_every_token(tiny):
    ours, ref = tiny
    (prompt,) = _prompts(ours.cfg.vocab_size, [17], seed=3)
    pre = Prefiller(ours.model)
    rows = pre.run([pre.chunk(prompt, all_logits=True)])[0]
    with torch.no_grad():
        full = ref(torch.tensor([prompt])).logits[0].float()
    assert rows.shape == full.shape
    assert (rows - full).abs().max().item() <= ATOL


def test_padding_does_not_change_outputs(tiny):
    ours, _ = tiny
    prompts = _prompts(ours.cfg.vocab_size, [5, 12], seed=4)
    pre = Prefiller(ours.model)
    plain = pre.run([pre.chunk(p) for p in prompts])
    padded = pre.run([pre.chunk(p) for p in prompts], pad_to=32)
    for a, b in zip(plain, padded):
        assert torch.equal(a, b)


# --- the real embedded default model: transformers reads the same GGUF independently ---------

@pytest.fixture(scope="module")
def smollm2(smollm2_hf):
    import transformers

    path = default_model_path()
    ours = load_model(path, "cpu", torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, smollm2_hf, tok


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
    "Émile a mangé des crêpes à Zürich",
]


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf(smollm2):
    ours, ref, tok = smollm2
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in SMOL_PROMPTS]
    assert [ours.tokenizer.encode(p) for p in SMOL_PROMPTS] == ids
    pre = Prefiller(ours.model, page_size=16)
    solo = [pre.last_logits([p])[0] for p in ids]
    for p, s in zip(ids, solo):
        _close(s, _hf_last_logits(ref, p))
    together = Prefiller(ours.model, page_size=16).last_logits(ids)
    for s, t in zip(solo, together):
        _close(t, s)
    assert ours.tokenizer.decode([int(solo[0].argmax())]) == " Paris"
