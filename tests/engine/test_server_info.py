"""get_server_info()'s SGLang `internal_states` from plait's scheduler stats (no model): SGLang's names and shapes,
and the accept length only once speculation ran, as SGLang reports it (bench_serving reads it with .get)."""

from __future__ import annotations

from plait.runtime.engine.server_info import internal_state

INFO = {
    "max_total_tokens": 4096,
    "max_running_requests": 256,
    "model_path": "/m",
    "api_key": None,
    "steps": {"decode": {"steps": 10, "rows": 20, "tokens": 20, "wall_s": 0.5}, "prefill": {}},
    "avg_spec_accept_length": 0.0,
    "spec_verify_steps": 0,
}


def test_sglangs_fields_from_plaits_stats():
    state = internal_state(INFO, startup_s=3.21)
    assert state["last_gen_throughput"] == 40.0 and state["startup_time"] == 3.21 and state["world_size"] == 1
    assert state["memory_usage"] == {"token_capacity": 4096}
    assert state["effective_max_running_requests_per_dp"] == 256 and state["model_path"] == "/m"
    assert "steps" not in state  # nested stats stay at the top level of the info
    assert "avg_spec_accept_length" not in state  # speculation off: left out, as SGLang does
    on = internal_state(
        {**INFO, "avg_spec_accept_length": 2.4, "spec_verify_steps": 7, "kv_cache_bytes": 3 << 30}, startup_s=None
    )
    assert on["avg_spec_accept_length"] == 2.4 and on["memory_usage"]["kvcache"] == 3.0 and "startup_time" not in on
