#!/usr/bin/env bash
# `plait serve` and `vllm serve` on one GPU machine, back to back, through bench_serving's OpenAI client: the
# serving rows of issue 32 (8B shape, dummy bf16 weights, the embedded model's tokenizer).
#   bash benchmarks/serving/vs_vllm.sh plait [ROW ...]     plait serve, then each row
#   bash benchmarks/serving/vs_vllm.sh vllm [ROW ...]      vllm serve (staged: ../shared/bench/vllm/README.md)
#   PLAIT_ARGS="--speculative-algorithm NGRAM" TAG=ngram bash benchmarks/serving/vs_vllm.sh plait random16
# Rows: random16 random64 randominf shared32 sharedinf long16 (default: all); burst (4,000 prompts at once: 10x
# the others, the overload row); copy16 (prompts that quote their context: speculation). Each row has its own seed, so
# no row hits prefixes cached by an earlier one. Carry .gpu/tok (model_folder.py --save-tokenizer .gpu/tok)
# and, for vllm, .shared and .stage/p4. plait's Python dependencies come from vLLM's staged site
# ($HOME/site, $HOME/vsrv) when the image lacks them. Results: $OUT/serving_<server>_<row>.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/out}"; mkdir -p "$OUT"
server=$1; shift
rows=("$@"); [ ${#rows[@]} -eq 0 ] && rows=(random16 random64 randominf shared32 sharedinf long16)
MODEL=/tmp/llama8b-smol
PROMPTS=${PROMPTS:-400}
TAG=${TAG:-}
[ -d "$HOME/site" ] && export PYTHONPATH="$HOME/site:$HOME/vsrv:${PYTHONPATH:-}"
python3 -c "import plait" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 benchmarks/serving/model_folder.py --tokenizer .gpu/tok --out $MODEL || exit 1

row_args() {
  local common="--random-output-len 128 --num-prompts $PROMPTS"
  case "$1" in
    random16) echo "--dataset random --random-input-len 512 $common --request-rate 16 --seed 11" ;;
    random64) echo "--dataset random --random-input-len 512 $common --request-rate 64 --seed 12" ;;
    randominf) echo "--dataset random --random-input-len 512 $common --request-rate inf --seed 13" ;;
    shared32) echo "--dataset shared-prefix --shared-prefix-len 2048 --num-groups 8 --question-len 128 $common --request-rate 32 --seed 14" ;;
    sharedinf) echo "--dataset shared-prefix --shared-prefix-len 2048 --num-groups 8 --question-len 128 $common --request-rate inf --seed 15" ;;
    long16) echo "--dataset long-mix --random-input-len 512 --long-input-len 8000 --long-fraction 0.1 $common --request-rate 16 --seed 16" ;;
    burst) echo "--dataset random --random-input-len 512 --random-output-len 128 --num-prompts 4000 --request-rate inf --seed 18" ;;
    copy16) echo "--dataset copy --copy-segment-len 128 --copy-repeats 4 $common --request-rate 16 --seed 17" ;;
    *) echo "unknown row $1" >&2; return 1 ;;
  esac
}

. benchmarks/serving/wait_up.sh  # wait_up PORT PID LOG

run_rows() {  # port, name
  for row in "${rows[@]}"; do
    args=$(row_args "$row") || continue
    timeout ${ROW_TIMEOUT:-300} python3 benchmarks/serving/bench_serving.py --backend openai --model m --port "$1" --vocab-size 49152 \
      $args --output-file "$OUT/serving_$2_$row.json" --tag "$2 $row" 2>&1 \
      | grep -E "Successful|Failed|Output token thr|TTFT|ITL|TPOT|Accept|error" | sed "s/^/$2 $row | /"
  done
}

case "$server" in
  plait)
    name="plait${TAG:+_$TAG}"
    python3 -m plait.runtime.server --model-path $MODEL --load-format dummy --port 30100 --served-model-name m \
      --context-length 10240 ${PLAIT_ARGS:-} > "$OUT/${name}_serve.log" 2>&1 &
    pid=$!
    t0=$(date +%s); wait_up 30100 $pid "$OUT/${name}_serve.log" || exit 1; echo "plait serve up in $(( $(date +%s) - t0 )) s"
    run_rows 30100 "$name"
    curl -s localhost:30100/get_server_info > "$OUT/${name}_server_info.json"  # steps by kind: --enable-step-timing
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('num_retractions', 'integrity_errors', 'last_integrity_error', 'token_usage')})" "$OUT/${name}_server_info.json" 2>/dev/null
    kill $pid; wait $pid 2>/dev/null ;;
  vllm)
    bash .shared/bench/vllm/gpu.sh serve $MODEL 30200 --max-model-len 10240 || exit 1
    run_rows 30200 vllm
    kill "$(cat $HOME/vllm_serve.pid)" ;;
esac
