# wait_up PORT PID LOG: until an OpenAI-compatible server on localhost:PORT answers /v1/models; fails (with the
# log's tail) when process PID has exited or after 400 s. Sourced by vs_vllm.sh and ../programs/vs_vllm_programs.sh.
wait_up() {
  for _ in $(seq 1 400); do
    curl -sf "localhost:$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died:"; tail -30 "$3"; return 1; }
    sleep 1
  done
  echo "server did not start"; tail -30 "$3"; return 1
}
