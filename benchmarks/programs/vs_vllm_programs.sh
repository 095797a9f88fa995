#!/usr/bin/env bash
# The SGLang paper's programs (paper_programs.py) on one GPU machine, back to back (issue 35): plait's DSL
# in-process with hints on and off, then the same programs one HTTP call per gen / select against
# `plait serve`, then against `vllm serve` (prefix caching on, as it ships); one table and plot at the end.
# 8B shape, dummy bf16 weights, the embedded model's tokenizer (benchmarks/serving/model_folder.py).
#   bash benchmarks/programs/vs_vllm_programs.sh                 all four drivers
#   SCALE=1 ONLY=mmlu,tot bash benchmarks/programs/vs_vllm_programs.sh dsl plait
# With the untimed warm-up programs the three parts take ~9 minutes: run them as separate device calls
# (`... dsl`, `... plait`, `... vllm` on one warm machine), then --merge their JSON files.
# Parts: dsl plait vllm (default: all). Carry .gpu/tok (model_folder.py --save-tokenizer .gpu/tok) and, for
# vllm, .shared and .stage/p4, with vLLM's site staged as for benchmarks/serving/vs_vllm.sh. plait's Python
# dependencies come from vLLM's staged site ($HOME/site, $HOME/vsrv) when the image lacks them.
# Results: $OUT/paper_programs_{dsl,http_plait,http_vllm,all}.json and paper_programs_all.png.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/out}"; mkdir -p "$OUT"; export OUT
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(dsl plait vllm)
MODEL=/tmp/llama8b-smol
SCALE=${SCALE:-0.5}  # program counts: half of paper_workloads' full counts keeps the three parts near 7 minutes
LENGTH_SCALE=${LENGTH_SCALE:-1}  # the paper's lengths
ONLY=${ONLY:-}
LIMIT=${LIMIT:-200}  # seconds per part's benchmark, so the whole call ends in time
WARM=${WARM:-1}  # programs of each workload run untimed per driver first (regexes compiled, first-use costs)
WARM_PASS=${WARM_PASS-1}  # each workload once whole on the part's first driver, untimed (WARM_PASS= : none)
[ -d "$HOME/site" ] && export PYTHONPATH="$HOME/site:$HOME/vsrv:${PYTHONPATH:-}"
python3 -c "import plait" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 benchmarks/serving/model_folder.py --tokenizer .gpu/tok --out $MODEL || exit 1
bench() {  # tag, then paper_programs.py arguments
  local tag=$1; shift
  timeout "$LIMIT" python3 benchmarks/programs/paper_programs.py --scale "$SCALE" --length-scale "$LENGTH_SCALE" ${ONLY:+--only $ONLY} \
    --warm "$WARM" ${WARM_PASS:+--warm-pass} --tag "$tag" "$@" 2>&1 | grep -v "^|" | sed "s/^/$tag | /"
}

. benchmarks/serving/wait_up.sh  # wait_up PORT PID LOG

merged=()
for part in "${parts[@]}"; do
  t0=$(date +%s)
  case "$part" in
    dsl)
      bench dsl --drivers dsl-hints,dsl-nohints --model-path $MODEL --load-format dummy --context-length 10240
      merged+=("$OUT/paper_programs_dsl.json") ;;
    plait)
      python3 -m plait.runtime.server --model-path $MODEL --load-format dummy --port 30100 --served-model-name m \
        --context-length 10240 ${PLAIT_ARGS:-} > "$OUT/programs_plait_serve.log" 2>&1 &
      pid=$!
      wait_up 30100 $pid "$OUT/programs_plait_serve.log" || continue
      echo "plait serve up in $(( $(date +%s) - t0 )) s"
      bench http_plait --drivers http-plait --plait-url http://localhost:30100/v1
      kill $pid; wait $pid 2>/dev/null
      merged+=("$OUT/paper_programs_http_plait.json") ;;
    vllm)
      VLLM_SERVER_DEV_MODE=1 bash .shared/bench/vllm/gpu.sh serve $MODEL 30200 --max-model-len 10240 --enable-prompt-tokens-details || continue
      bench http_vllm --drivers http-vllm --vllm-url http://localhost:30200/v1
      kill "$(cat $HOME/vllm_serve.pid)"
      merged+=("$OUT/paper_programs_http_vllm.json") ;;
    *) echo "unknown part $part (dsl plait vllm)"; continue ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s"
done
existing=(); for f in "${merged[@]}"; do [ -f "$f" ] && existing+=("$f"); done
[ ${#existing[@]} -gt 0 ] && python3 benchmarks/programs/paper_programs.py --merge "${existing[@]}" --tag all
