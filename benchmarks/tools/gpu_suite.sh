#!/usr/bin/env bash
# The GPU checks and benchmarks of issue 7, in the order they are run on the device machine.
#   bash benchmarks/tools/gpu_suite.sh tests|profile|sweeps|cascade|one_batch|offline|rounds|serving ...
# OFFLINE_ARGS / ROUNDS_ARGS add flags to those steps (e.g. ROUNDS_ARGS=--skip-off, OFFLINE_ARGS="--skip-transformers").
# SERVING_MODEL / SERVING_RATES / SERVING_PROMPTS pick the serving step's shape, request rates and prompt count.
# Packages missing on that machine (pyzmq, fastapi, ...) travel as wheels in .whl/ (see the device
# README); the shared workload file travels in .shared/bench/. Results land in $OUT (else benchmarks/out).
# To run exactly a commit (helpers' uncommitted edits travel with the working tree otherwise):
#   here:  mkdir -p .snap && git archive --format=tar HEAD | gzip > .snap/plait.tgz   (.snap is git-ignored)
#   there: mkdir -p /tmp/p && tar xzf .snap/plait.tgz -C /tmp/p && cp -r .whl .shared /tmp/p/ && cd /tmp/p && ...
#   carry [".whl", ".shared", ".snap"]; flashinfer: also ".fi" and benchmarks/tools/gpu_flashinfer_check.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/out}"; mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
python3 -c "import plait" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for step in "$@"; do
  case "$step" in
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 tests/attention/test_triton_attention.py \
        tests/kernels/test_fused_kernels.py tests/kernels/test_decode_kernels.py tests/kernels/test_fused_gemv.py tests/attention/test_cascade_attention.py tests/executor/test_graph_variants.py \
        tests/executor/test_gpu_correctness.py -s 2>&1 \
        | grep -vE "Warning|warn\(|^\s*$" | tee "$OUT/gpu_tests.log" | tail -15 ;;
    profile)  # GPU time per kernel of a batch-1 decode step, next to the graph step
      for m in llama-3.1-8b llama-3.2-1b; do
        timeout 120 python3 benchmarks/kernels/profile_decode_step.py --model $m 2>&1 | grep -E "graph|us/step" | head -14
      done ;;
    sweeps)  # the tile choices: split-KV decode policy, extend tiles, skinny matmul vs cuBLAS
      timeout 330 python3 benchmarks/kernels/sweep_decode_attention.py --shapes 8b 2>&1 | grep -E "^8b|^1b|overall"
      timeout 150 python3 benchmarks/kernels/sweep_extend_attention.py 2>&1 | grep -vE "failed|[Ww]arn"
      timeout 200 python3 benchmarks/kernels/bench_gemv.py --model llama-3.1-8b 2>&1 | grep -E "^m=|step" ;;
    cascade)  # shared-prefix decode attention vs the plain split-KV kernel, one layer, graphs
      timeout 300 python3 benchmarks/kernels/bench_cascade_attention.py ${CASCADE_ARGS:---quick} 2>&1 | tail -20 ;;
    fused)
      timeout 120 python3 benchmarks/kernels/bench_fused_kernels.py --quick 2>&1 | tail -25 ;;
    one_batch_8b|one_batch_1b|one_batch)
      models="llama-3.2-1b llama-3.1-8b"; [ "$step" = one_batch_8b ] && models=llama-3.1-8b
      [ "$step" = one_batch_1b ] && models=llama-3.2-1b
      for m in $models; do
        timeout 300 python3 benchmarks/engine/bench_one_batch.py --model $m --batch-sizes 1 8 32 64 128 256 \
          --hf-batch-sizes 1 32 2>&1 | grep -E "plait|transformers|GPU"
      done ;;
    offline)
      for m in ${OFFLINE_MODELS:-llama-3.2-1b llama-3.1-8b}; do
        timeout 420 python3 benchmarks/engine/bench_offline.py --model $m --workload offline ${OFFLINE_ARGS:-} 2>&1 \
          | grep -E "^plait|^transformers|roofline|^steps|Error"
      done ;;
    rounds)
      # Prefix-sharing streams (fewshot, multiturn, tree), radix cache on then off, vs vLLM's figures.
      timeout 280 python3 benchmarks/engine/bench_rounds.py --model llama-3.1-8b ${ROUNDS_ARGS:-} 2>&1 | tee "$OUT/bench_rounds.log" \
        | grep -E "^cache|^stream|^fewshot|^multiturn|^tree|^target|^saved|Error|error" ;;
    serving)
      model=${SERVING_MODEL:-llama-3.2-1b}
      python3 -m plait.runtime.server --model-path $model --load-format dummy --port 30123 \
        > "$OUT/server.log" 2>&1 &
      srv=$!
      for i in $(seq 1 180); do curl -sf localhost:30123/health >/dev/null && break; sleep 1; done
      for rate in ${SERVING_RATES:-16 64 inf}; do
        # Each rate starts cold: the prompts repeat across rates (one seed), so a warm radix cache would
        # turn later rates' prefills into hits.
        curl -sf -X POST localhost:30123/flush_cache >/dev/null || echo "flush_cache failed"
        timeout 200 python3 benchmarks/serving/bench_serving.py --port 30123 --backend plait --dataset random \
          --num-prompts ${SERVING_PROMPTS:-400} --random-input-len 512 --random-output-len 128 --request-rate $rate \
          --vocab-size 30000 --output-file "$OUT/bench_serving_gpu_${model}_rate_$rate.json" --tag "H200 $model dummy" 2>&1 \
          | grep -vE "^\s*$" | tail -12
      done
      kill $srv ;;
  esac
done
