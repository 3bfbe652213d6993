#!/usr/bin/env bash
# Prepare what bench/h200_session.sh needs on the GPU machine (run here, in the repo root):
#   .whl/         wheels the GPU image lacks (fastapi, uvicorn, pydantic(-settings), ...)
#   .gpu_assets/  SmolLM2's tokenizer exported from the embedded GGUF (the 98 MB GGUF itself
#                 cannot travel; `python -m service.tokenizer export`) with a config.json: a
#                 tokenizer-only HF directory for MODEL_PRESET runs
# Both are ignored by git (.git/info/exclude) and carried with the device call: carry
# [".whl", ".gpu_assets"].
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
wheels=()
for p in fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv uvicorn \
         httptools uvloop annotated-types typing-inspection typing-extensions opentelemetry-api \
         gguf pyzmq msgspec; do
  wheels+=("$p==$("$PY" -m pip show "$p" | sed -n 's/^Version: //p')")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl "${wheels[@]}"
env -u MODEL_PATH "$PY" -m service.tokenizer export .gpu_assets/smollm2  # the embedded GGUF
"$PY" - <<'PYEOF'
import json

from service.model.files import default_model_path, gguf_metadata, read_gguf
from service.model.loader_gguf import config_from_gguf

path = default_model_path()
c = config_from_gguf(gguf_metadata(read_gguf(path)), str(path))
json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=c.vocab_size,
               hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
               num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_norm_eps,
               rope_theta=c.rope_theta, tie_word_embeddings=True,
               max_position_embeddings=c.max_position_embeddings,
               bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id),
          open(".gpu_assets/smollm2/config.json", "w"))
PYEOF
du -sh .whl .gpu_assets
