"""Write tests/model/data/llama-fp8-block/: a tiny random Llama quantized by llmcompressor's
FP8_BLOCK scheme, as published FP8-block checkpoints are made (not run by the tests).

Usage (its own venv: llmcompressor pins its own transformers):
  python3 -m venv /tmp/llmc-venv && /tmp/llmc-venv/bin/pip install torch==2.13.0 llmcompressor
  /tmp/llmc-venv/bin/python tests/model/make_fp8_block.py"""

from __future__ import annotations

import tempfile
from pathlib import Path

import llmcompressor
import torch
import transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

OUT = Path(__file__).resolve().parent / "data" / "llama-fp8-block"


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # larger than init defaults so that mistakes show in the logits
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the model's config from disk
        model.save_pretrained(tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_BLOCK",
                                                         ignore=["lm_head"]))
        model.save_pretrained(OUT, save_compressed=True)
    print(f"llmcompressor {llmcompressor.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}:", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
