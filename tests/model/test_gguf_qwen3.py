"""A Qwen3 GGUF as llama.cpp's convert_hf_to_gguf.py writes one (tensor names, metadata keys, no
Q/K permutation, a byte-level BPE tokenizer with pre "qwen2") loads and matches transformers'
model it was written from; RoPE scaling it cannot express and GGUF architectures without a
family are refused."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from service.model.errors import ModelLoadError, UnsupportedArchitecture
from service.model.families import FAMILIES
from service.model.files import gguf_metadata, read_gguf
from service.model.loader import load_model
from tests.model.checkpoints import CORPUS
from tests.model.prefill import Prefiller

ATOL = 1e-4
VOCAB = 320  # the model's rows; the tokenizer has fewer tokens, llama.cpp pads the list
# Qwen2/2.5/3's tokenizer.json split (the GGUF's tokenizer.ggml.pre "qwen2")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # added, special: true
USER = ["<think>", "</think>"]  # added, special: false (llama.cpp: USER_DEFINED)
NORMAL, CONTROL_T, USER_T, UNUSED_T = 1, 3, 4, 5  # gguf.TokenType
TEXTS = [
    "Hello world, this is a tiny prompt 12345.",
    "<|im_start|>user\nWhat's a KV cache?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>",
    "def add(a, b):\n    return a + b\n\n\n",
    "Émile a mangé des crêpes à Zürich",
]


def qwen_tokenizer() -> Tokenizer:
    """A small tokenizer built as Qwen's tokenizer.json is (NFC, the qwen2 split, byte level)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER])
    return tok


def hf_model():
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # far from the init defaults, so that a misplaced tensor shows
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    return model


def write_tokenizer(w, tok: Tokenizer) -> None:
    """convert_hf_to_gguf's _set_vocab_gpt2: tokens by id padded to the model's vocabulary
    with [PADn] (UNUSED), added special tokens CONTROL, other added tokens USER_DEFINED."""
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(VOCAB):
        t = by_id.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        types.append(UNUSED_T if t is None else NORMAL if t not in added
                     else CONTROL_T if added[t] else USER_T)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    w.add_add_bos_token(False)


LAYER = {  # HF -> llama.cpp names, per layer (tensor_mapping.py, MODEL_ARCH.QWEN3)
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return None  # tied: convert writes no output.weight
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest.removesuffix('.weight')]}.weight"


def write_gguf(path, model, tok: Tokenizer, rope_scaling: str | None = None,
               rope_freqs: list[float] | None = None) -> None:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("Tiny Qwen3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(4.0)
    if rope_freqs is not None:  # what convert writes for Llama 3.1's llama3 scaling
        w.add_tensor("rope_freqs.weight", torch.tensor(rope_freqs).numpy())
    write_tokenizer(w, tok)
    for name, t in model.state_dict().items():
        if (out := gguf_name(name)) is not None:  # numpy (rows, cols): GGUF lists (cols, rows)
            w.add_tensor(out, t.detach().float().numpy().copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tok, ref = qwen_tokenizer(), hf_model()
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    write_gguf(path, ref, tok)
    return path, tok, ref, load_model(path, "cpu", torch.float32)


def test_the_file_is_what_llama_cpp_writes(qwen3):
    path = qwen3[0]
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    assert meta["general.architecture"] == "qwen3"
    assert {f"qwen3.{k}" for k in (
        "context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "rope.freq_base", "attention.layer_norm_rms_epsilon",
    )} <= set(meta)
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    assert "output.weight" not in shapes and len(shapes) == 2 + 3 * 11
    assert shapes["blk.0.attn_q.weight"] == [64, 4 * 32]  # fastest-first: (in, out)
    assert shapes["blk.0.attn_k_norm.weight"] == [32]
    assert shapes["token_embd.weight"] == [64, VOCAB]


def test_config_from_the_gguf(qwen3):
    cfg = qwen3[3].cfg
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen3", 4, 2, 32)
    assert cfg.q_size != cfg.hidden_size and cfg.qk_norm and not cfg.qkv_bias
    assert cfg.tie_word_embeddings and qwen3[3].model.lm_head is None
    assert (cfg.vocab_size, cfg.rope_theta) == (VOCAB, 1e6)
    assert cfg.rms_norm_eps == pytest.approx(1e-6)  # GGUF holds it in float32


def test_tokenizer_matches_the_hf_one(qwen3):
    _, tok, _, ours = qwen3
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ours.tokenizer.encode(text) == ids, text
        assert ours.tokenizer.decode(ids) == text
    think = tok.token_to_id("<think>")
    assert ours.tokenizer.encode("a<think>b") == [*tok.encode("a").ids, think,
                                                 *tok.encode("b").ids]
    assert ours.tokenizer.decode([think], skip_special=True) == "<think>"  # not special
    assert ours.tokenizer.decode([tok.token_to_id("<|im_end|>")], skip_special=True) == ""
    assert ours.tokenizer.token_str(ours.tokenizer.eos_id) == "<|im_end|>"


def test_logits_match_transformers(qwen3):
    _, tok, ref, ours = qwen3
    g = torch.Generator().manual_seed(1)
    prompts = [tok.encode(t).ids for t in TEXTS] + [
        torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 37)]
    got = Prefiller(ours.model).last_logits(prompts)
    for p, ours_row in zip(prompts, got):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0, -1].float()
        diff = (ours_row - want).abs().max().item()
        assert diff <= ATOL, f"max abs diff {diff:.3g} > {ATOL}"


def test_rope_scaling_type_the_loader_cannot_run_is_refused(qwen3, tmp_path):
    _, tok, ref, _ = qwen3
    path = tmp_path / "scaled.gguf"
    write_gguf(path, ref, tok, rope_scaling="yarn")
    with pytest.raises(ModelLoadError, match=r"RoPE scaling 'yarn' \(qwen3\.rope\.scaling\."
                                             r"type\)") as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_rope_freqs_carry_llama3_scaling(qwen3, tmp_path):
    """llama.cpp writes Llama 3.1's llama3 RoPE scaling as per-pair divisors (rope_freqs): the
    model matches transformers' with that scaling in its config."""
    import transformers

    from kernels.rope import _llama3_inv_freq

    _, tok, ref, _ = qwen3
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    d, theta = ref.config.head_dim, ref.config.rope_parameters["rope_theta"]
    base = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    path = tmp_path / "llama3.gguf"
    write_gguf(path, ref, tok, rope_freqs=(base / _llama3_inv_freq(base, scaling)).tolist())
    ours = load_model(path, "cpu", torch.float32)
    assert ours.cfg.rope_scaling["rope_type"] == "freq_factors"
    cfg = ref.config.to_dict() | {"rope_parameters": scaling | {"rope_theta": theta}}
    scaled = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).eval()
    scaled.load_state_dict(ref.state_dict())
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = scaled(torch.tensor([prompt])).logits[0, -1].float()
        plain = ref(torch.tensor([prompt])).logits[0, -1].float()
    got = Prefiller(ours.model).last_logits([prompt])[0]
    assert (got - want).abs().max().item() <= ATOL
    assert (got - plain).abs().max().item() > 100 * ATOL  # the scaling shows at 60 positions


def test_unit_rope_freqs_change_nothing(qwen3, tmp_path):
    _, tok, ref, ours = qwen3
    path = tmp_path / "unit.gguf"
    write_gguf(path, ref, tok, rope_freqs=[1.0] * 16)
    again = load_model(path, "cpu", torch.float32)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert torch.equal(Prefiller(again.model).last_logits(prompt)[0],
                       Prefiller(ours.model).last_logits(prompt)[0])


def test_gguf_without_a_family_is_refused(tmp_path):
    import gguf

    path = tmp_path / "gemma3.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", torch.zeros(16, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture) as e:
        load_model(path)
    msg = str(e.value)
    assert "gemma3.gguf: unsupported GGUF architecture 'gemma3'; supported: " in msg
    assert all(f.gguf_arch in msg for f in FAMILIES.values() if f.gguf_arch)
    assert "\n" not in msg
