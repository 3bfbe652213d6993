"""The embedded default model (a GGUF) as an fp32 Hugging Face LlamaForCausalLM directory."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.model.prefill

from safetensors.torch import save_file

from service.model.files import default_model_path, gguf_metadata, read_gguf, tokenizer_of
from service.model.loader_gguf import config_from_gguf, gguf_tensors
from service.model.tokenizer_export import export_tokenizer


def hf_config(cfg, tied: bool) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.activation, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }


def write(gguf: Path, out: Path) -> None:
    reader = read_gguf(gguf)
    cfg = config_from_gguf(gguf_metadata(reader), str(gguf))
    assert cfg.arch == "llama" and cfg.rope_scaling is None, f"{gguf}: not a plain Llama"
    tensors, tied = gguf_tensors(reader, cfg, str(gguf))
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tied), indent=2) + "\n")
    export_tokenizer(tokenizer_of(gguf), out, cfg.max_position_embeddings)


def verify(gguf: Path, out: Path, text: str = "The quick brown fox jumps over the lazy dog. " * 8,
           atol: float = 1e-3) -> float:
    """transformers on `out` gives our service's last-token logits on `gguf` (HF Q/K row order)."""
    import torch
    import transformers

    from service.model.loader import load_model
    from tests.model.prefill import Prefiller

    ids = tokenizer_of(gguf).encode(text)
    assert transformers.AutoTokenizer.from_pretrained(out)(text).input_ids == ids, "tokenizers"
    ours = Prefiller(load_model(gguf, "cpu", torch.float32).model).last_logits([ids])[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (ref(torch.tensor([ids])).logits[0, -1] - ours).abs().max().item()
    assert diff <= atol, f"{out}: logits differ from the GGUF's by {diff:.3g} > {atol}"
    return diff


def model_dir(cache: Path, gguf: Path | None = None) -> Path:
    """The directory for `gguf` (default: the embedded model), written once per content hash."""
    gguf = gguf or default_model_path()
    h = hashlib.sha256(Path(__file__).read_bytes())
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    out = cache / f"smollm2-fp32-{h.hexdigest()[:16]}"
    if not (out / "config.json").is_file():
        for stale in cache.glob("smollm2-fp32-*"):  # 0.5 GB each
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write(gguf, tmp)
        print(f"{tmp}: max |Δ logit| vs the GGUF {verify(gguf, tmp):.2g}", flush=True)
        tmp.rename(out)
    return out


if __name__ == "__main__":
    print(model_dir(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm-decode-models")))
