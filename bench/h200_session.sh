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
step score_tests "${T_ST:-200}" python3 -m pytest -v -rP -m gpu -p no:cacheprovider \
  tests/engine/test_shared_query.py tests/engine/test_full_graph_gpu.py \
  tests/engine/test_graph_gpu.py -k "not nccl"
step score "${T_SCORE:-420}" env OUT="$R" python3 bench/score.py ${SCORE_ARGS:-}
step score_http "${T_SCORE_HTTP:-420}" env OUT="$R" python3 bench/score.py --http \
  --env MODEL_PATH="$PWD/.gpu_assets/smollm2" --workloads "${SCORE_HTTP_WL:-1024:64:20,4096:64:20,1024:256:20}"
step bound "${T_BOUND:-300}" env OUT="$R" python3 bench/bound.py ${BOUND_ARGS:-}
# retrieval (#50): embeddings vs /v1/prefill, rerank QPS sweeps; presets take SmolLM2's tokenizer
step retrieval "${T_RET:-400}" env OUT="$R" python3 bench/retrieval.py \
  --env MODEL_PATH="$PWD/.gpu_assets/smollm2" ${RET_ARGS:-}
step dp "${T_DP:-240}" env OUT="$R" python3 -m bench.dp --models "${DP_MODELS:-llama-3.2-1b,llama-3.1-8b}"
step kernel_tests "${T_KT:-120}" python3 -m pytest -v -m gpu -p no:cacheprovider \
  tests/kernels/test_kernels_gpu.py \
  -k "batch_of_64 or table_configs or graph_capture or opcheck or prepared or sm90 or repeated"
step fused_tests "${T_FT:-60}" python3 -m pytest -v -p no:cacheprovider \
  tests/kernels/test_logits_summary.py tests/kernels/test_extend_attention.py -k "fused or summary or lowest or dispatch"
# model families (#41): GPU tests of the new paths, bound and e2e rows, start-up sizing
FAMILIES=${FAMILIES:-qwen3-8b,qwen3-0.6b,gemma-3-1b,gemma-3-270m}
step family_tests "${T_FAM:-240}" python3 -m pytest -v -rP -m gpu -p no:cacheprovider \
  tests/model/test_model_gpu.py tests/engine/test_full_graph_gpu.py tests/kernels/test_kernels_gpu.py \
  -k "window or qk_norm or gelu or gemma or qwen3 or triton_matches or opcheck"
step family_bound "${T_FB:-420}" env OUT="$R" python3 bench/bound.py --models "$FAMILIES" --breakdown
step family_e2e "${T_FE:-420}" env OUT="$R" python3 bench/e2e.py --models "${E2E_MODELS:-$FAMILIES}" \
  --variants ours-graph,hf-sdpa
step sizing "${T_SZ:-300}" env OUT="$R" MODEL_PATH="$PWD/.gpu_assets/smollm2" python3 bench/sizing.py --models "${SIZING_MODELS:-qwen3-8b,gemma-3-1b,llama-3.1-8b}"
# FP8 (#42), each bench into its own folder: GPU tests, GEMMs, e2e against bf16 and transformers
# in one run, the FP8 bound (ours and transformers in it), bf16 against FP8 start-up sizing
FP8_MODELS=${FP8_MODELS:-llama-3.1-8b}
step fp8_tests "${T_F8T:-200}" python3 -m pytest -v -rs -m "gpu or not gpu" -p no:cacheprovider \
  tests/kernels/test_quant_fp8.py tests/kernels/test_fp8_gemm.py tests/model/test_fp8_gpu.py \
  tests/engine/test_full_graph_gpu.py -k "fp8 or not full_graph"
step fp8_gemm "${T_F8G:-150}" env OUT="$R/fp8_gemm" python3 bench/fp8_gemm.py \
  --models llama-3.1-8b --rows 128,1024,4096,8192
step fp8_e2e "${T_F8E:-300}" env OUT="$R/fp8_e2e" python3 bench/e2e.py --models "$FP8_MODELS" \
  --variants ours-graph,ours-graph-fp8,hf-sdpa
step fp8_bound "${T_F8B:-300}" env OUT="$R/fp8_bound" python3 bench/bound.py --models "$FP8_MODELS" \
  --fp8
step fp8_sizing "${T_F8S:-200}" env OUT="$R/fp8_sizing" MODEL_PATH="$PWD/.gpu_assets/smollm2" \
  python3 bench/sizing.py --models llama-3.1-8b,llama-3.1-8b:fp8
step attention_window "${T_AW:-200}" env OUT="$R" python3 bench/attention.py --cases window
step attention "${T_ATTN:-420}" env OUT="$R" python3 bench/attention.py ${ATTN_ARGS:-}
step sm90_launch "${T_SL:-300}" env OUT="$R" python3 bench/sm90_launch.py
step capture "${T_CAP:-95}" env OUT="$R" python3 -m bench.capture --budget-s "${CAP_BUDGET:-50}"
step sanitizer "${T_SAN:-35}" compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m bench.capture --sanitize-smoke
step e2e "${T_E2E:-110}" env OUT="$R" python3 bench/e2e.py --profile \
  --models "${E2E_MODELS:-smollm2-135m,llama-3.2-1b,llama-3.1-8b,qwen2.5-0.5b}" \
  --variants "${E2E_VARIANTS:-ours-graph,ours-eager,ours-refattn,hf-sdpa}"
# An interleaved A/B (not in the default STEPS; STEPS=ab): a worktree of the before commit in
# .before (carried: carry [".whl", ".before"]), against this tree; AB_CHANGE names it (the
# report's file), AB_BEFORE says what the before tree is, AB_KNOWN the differences expected
# beforehand, e.g. AB_CHANGE=restructure AB_BEFORE="tag before-restructure (42b08ae)". Each
# benchmark runs before,
# after, before, after, each run its own process, into $R/ab/{before1,after1,before2,after2};
# e2e first, then attention, then capture (near-deterministic memory: the one to lose;
# AB_BENCHES picks a subset, e.g. AB_BENCHES=capture). The
# whole step stays within AB_BUDGET_S: a run is skipped when less than its expected time is
# left, and cut at the budget. Durations land in $R/ab/times.tsv, the comparison (python3
# bench/ab_compare.py report) in $R/ab/ab-$AB_CHANGE-*.md. AB_ATTN=small runs
# bench/attention.py --small (S = 512, 1k, both head configs) instead of the subset below.
AB_E2E_MODELS=${AB_E2E_MODELS:-smollm2-135m,qwen2.5-0.5b,llama-3.2-1b}
AB_E2E=(bench/e2e.py --variants "${AB_E2E_VARIANTS:-ours-graph}" --models "$AB_E2E_MODELS")
# --budget-s 1: the first run (smollm2-135m main, with latency) only; the next is skipped
AB_CAP=(-m bench.capture --models smollm2-135m --budget-s 1)
if [ "${AB_ATTN:-subset}" = small ]; then AB_ATT=(bench/attention.py --small)
else AB_ATT=("$PWD/bench/ab_compare.py" run-attention --heads 32/8 --dims 64,128
             --seqs "${AB_ATTN_SEQS:-512,1024,2048,8192,16384}"); fi
case $AB_E2E_MODELS in *8b*) AB_X_E2E=${AB_X_E2E:-90} ;; *) AB_X_E2E=${AB_X_E2E:-50} ;; esac
ab_run() {  # ab_run <bench> <before1|after1|...> <limit s> <expected s> <python3 args...>
  local bench=$1 run=$2 limit=$3 expect=$4 left=$((AB_END - SECONDS)) t0=$SECONDS rc
  shift 4
  local dir=$R/ab/$run
  if [ "$left" -lt "$expect" ]; then
    echo "   ab $bench $run skipped: ${left}s of the budget left, ${expect}s expected"
    printf '%s\t%s\t-\t0\tskipped: %ss left\n' "$bench" "$run" "$left" >> "$R/ab/times.tsv"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$dir"
  echo "== ab $bench $run ($(date +%T), limit ${limit}s)"
  ( if [ "${run%?}" = before ]; then cd .before || exit 97; fi
    OUT=$dir timeout -k 5 "$limit" python3 "$@" ) > "$dir/$bench.log" 2>&1
  rc=$?
  echo "   rc=$rc $((SECONDS - t0))s $(tail -1 "$dir/$bench.log")"
  printf '%s\t%s\t%s\t%s\t%s\n' "$bench" "$run" "$rc" "$((SECONDS - t0))" \
    "$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "cut at ${limit}s")" >> "$R/ab/times.tsv"
  tar czf "$ROOT/results$TAG.tgz" -C "$ROOT" "r$TAG"
}
ab_step() {
  case " $STEPS " in *" ab "*) ;; *) return 0 ;; esac
  if [ ! -d .before/service ]; then echo "== ab: no .before worktree (carry .before)"; return 0; fi
  AB_END=$((SECONDS + ${AB_BUDGET_S:-480}))
  mkdir -p "$R/ab"
  printf 'bench\trun\trc\tseconds\tnote\n' > "$R/ab/times.tsv"
  local run benches=" ${AB_BENCHES:-e2e attention capture} "
  for run in before1 after1 before2 after2; do
    case $benches in *" e2e "*) ab_run e2e "$run" "${T_AB_E2E:-150}" "$AB_X_E2E" "${AB_E2E[@]}" ;; esac
  done
  for run in before1 after1 before2 after2; do
    case $benches in *" attention "*)
      ab_run attention "$run" "${T_AB_ATTN:-120}" "${AB_X_ATTN:-45}" "${AB_ATT[@]}" ;; esac
  done
  for run in before1 after1 before2 after2; do
    case $benches in *" capture "*)
      ab_run capture "$run" "${T_AB_CAP:-90}" "${AB_X_CAP:-30}" "${AB_CAP[@]}" ;; esac
  done
  python3 bench/ab_compare.py report "$R/ab" --out-dir "$R/ab" --change "${AB_CHANGE:-change}" \
    --before "${AB_BEFORE:-the tree in .before}" --known "${AB_KNOWN:-}" > "$R/ab/report.log" 2>&1
  echo "== ab report rc=$? ($(date +%T)): $(tail -1 "$R/ab/report.log")"
  tar czf "$ROOT/results$TAG.tgz" -C "$ROOT" "r$TAG"
}
ab_step
