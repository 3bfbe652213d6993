#!/usr/bin/env bash
# One H200 session, most important first; results are re-packed after every step so a run cut
# short still returns what it measured. First, here: `bash bench/prepare_device.sh` (the wheels
# the GPU image lacks in .whl/, SmolLM2's tokenizer in .gpu_assets/); carry both.
# Usage (device tool, repo root): bash bench/h200_session.sh   -> $OUT/results.tgz
# On a two-GPU machine, two instances can share the call: TAG names each one's results, e.g.
#   CUDA_VISIBLE_DEVICES=0 TAG=a STEPS=capture bash bench/h200_session.sh &
#   CUDA_VISIBLE_DEVICES=1 TAG=b STEPS=e2e bash bench/h200_session.sh; wait
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
TAG=${TAG:-}; R=$OUT/r$TAG; mkdir -p "$R"; ROOT=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$R/gpu.txt"
STEPS=${STEPS:-load load_x64 load1b load1b_x64 gpu_tests dp kernel_tests capture sanitizer e2e}
step() {
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   rc=$? $(tail -1 "$R/$name.log")"
  tar czf "$ROOT/results$TAG.tgz" -C "$ROOT" "r$TAG"
}
# HTTP vs engine-only, 128-token prompts: one prompt per request, then 64 (LOAD_S seconds a level)
LOAD=(--spawn --env DEVICE=cuda --env MODEL_PATH="$PWD/.gpu_assets/smollm2" --prompt-tokens 128
      --duration "${LOAD_S:-5}" --max-requests 100000 --ready-timeout 120)
step load "${T_LOAD:-200}" env OUT="$R" python3 bench/load.py "${LOAD[@]}" \
  --env MODEL_PRESET=smollm2-135m --concurrency 1,16,64,128,256
step load_x64 "${T_LOAD:-200}" env OUT="$R" python3 bench/load.py "${LOAD[@]}" \
  --env MODEL_PRESET=smollm2-135m --concurrency 1,2,4 --prompts-per-request 64
step load1b "${T_LOAD:-200}" env OUT="$R" python3 bench/load.py "${LOAD[@]}" \
  --env MODEL_PRESET=llama-3.2-1b --concurrency 1,16,64,128
step load1b_x64 "${T_LOAD:-200}" env OUT="$R" python3 bench/load.py "${LOAD[@]}" \
  --env MODEL_PRESET=llama-3.2-1b --concurrency 1,2,4 --prompts-per-request 64
# the same client against the code before the engine process (a worktree in .before, carried)
step load_before "${T_LOAD:-200}" env OUT="$R/before" bash -c 'cd .before && python3 bench/load.py "$@"' _ \
  "${LOAD[@]}" --env MODEL_PRESET="${BEFORE_PRESET:-smollm2-135m}" --concurrency 1,16,64 --env API_WORKERS=1
step gpu_tests "${T_TESTS:-70}" python3 -m pytest -v -rP -m gpu -p no:cacheprovider \
  tests/engine/test_graph_gpu.py tests/model/test_model_gpu.py
step fold_tests "${T_FOLD:-90}" python3 -m pytest -v -p no:cacheprovider \
  tests/kernels/test_rope.py tests/kernels/test_activation.py \
  tests/kernels/test_kernels_gpu.py -k "rope or silu or linear or asserts or pick or opcheck or graph_capture"
step full_tests "${T_FULL:-150}" python3 -m pytest -v -rP -m gpu -p no:cacheprovider \
  tests/engine/test_full_graph_gpu.py tests/engine/test_graph_gpu.py -k "not nccl"
step bound "${T_BOUND:-300}" env OUT="$R" python3 bench/bound.py ${BOUND_ARGS:-}
step dp "${T_DP:-240}" env OUT="$R" python3 -m bench.dp --models "${DP_MODELS:-llama-3.2-1b,llama-3.1-8b}"
step kernel_tests "${T_KT:-120}" python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/kernels/test_kernels_gpu.py \
  -k "batch_of_64 or table_configs or graph_capture or opcheck or prepared or sm90 or repeated"
step fused_tests "${T_FT:-60}" python3 -m pytest -v -p no:cacheprovider \
  tests/kernels/test_logits_summary.py tests/kernels/test_extend_attention.py -k "fused or summary or lowest or dispatch"
step attention "${T_ATTN:-420}" env OUT="$R" python3 bench/attention.py ${ATTN_ARGS:-}
step capture "${T_CAP:-95}" env OUT="$R" python3 -m bench.capture --budget-s "${CAP_BUDGET:-50}"
step sanitizer "${T_SAN:-35}" compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m bench.capture --sanitize-smoke
step e2e "${T_E2E:-110}" env OUT="$R" python3 bench/e2e.py --profile \
  --models "${E2E_MODELS:-smollm2-135m,llama-3.2-1b,llama-3.1-8b,qwen2.5-0.5b}" \
  --variants "${E2E_VARIANTS:-ours-graph,ours-eager,ours-refattn,hf-sdpa}"
