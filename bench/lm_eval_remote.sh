#!/usr/bin/env bash
# lm-eval against a running service with nothing but its URL: `local-completions` with
# `tokenizer_backend=remote` (the service's /tokenizer_info, /tokenize and /detokenize stand in for
# a local tokenizer) on two small local tasks in bench/lm_eval/: a multiple-choice loglikelihood
# task and a rolling-perplexity task. Needs `pip install "lm-eval[api]"`; nothing is downloaded.
#   bench/lm_eval_remote.sh [BASE_URL [lm_eval args...]]    (BASE_URL: http://127.0.0.1:8000)
# With API_KEY set, the key goes to the tokenizer routes (auth_token) and to /v1/completions
# (OPENAI_API_KEY). lm-eval writes its results_*.json under $OUTPUT_PATH (default
# ${TMPDIR:-/tmp}/lm-eval-remote); a run kept goes to bench/results/ as
# lm-eval-remote-<cpu|gpu>-<date>.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
url=${1:-http://127.0.0.1:8000}
shift $(( $# > 0 ? 1 : 0 ))
args="base_url=${url%/}/v1/completions,tokenizer_backend=remote,tokenized_requests=True"
if [[ -n "${API_KEY:-}" ]]; then
  args+=",auth_token=$API_KEY"
  export OPENAI_API_KEY=$API_KEY
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "${PY:-.venv/bin/python}" -m lm_eval --model local-completions --model_args "$args" \
  --include_path bench/lm_eval --tasks local_facts_mc,local_prose_ppl \
  --output_path "${OUTPUT_PATH:-${TMPDIR:-/tmp}/lm-eval-remote}" "$@"
