"""`get_server_info()`'s SGLang shape: the settings, the scheduler's facts and counters at the top level (plait's
own keys), plus SGLang's `internal_states`, a list with one entry per scheduler (one here) holding the
settings again and the state SGLang's tools read under SGLang's names and shapes.

What plait's scheduler reports maps onto SGLang's fields as follows; a field plait has no value for is left
out, as SGLang does (bench_serving reads `internal_states[0].get("avg_spec_accept_length")`):

| SGLang field | plait's source |
|---|---|
| `last_gen_throughput` | decode tokens / decode wall seconds of the run (SGLang: over its last log interval) |
| `memory_usage.token_capacity` | `max_total_tokens` |
| `memory_usage.kvcache` (GB) | `kv_cache_bytes`, when the scheduler reports it |
| `memory_usage.weight` (GB) | `weight_bytes`, when the scheduler reports it |
| `effective_max_running_requests_per_dp` | `max_running_requests` |
| `startup_time` (s) | the Engine's start-up, measured by the Engine |
| `world_size` | 1 (one device) |
| `avg_spec_accept_length` | `avg_spec_accept_length`, when speculative decoding ran (`spec_verify_steps` > 0) |
"""

from __future__ import annotations

from typing import Any, Optional

_GB = 1 << 30


def internal_state(info: dict[str, Any], startup_s: Optional[float]) -> dict[str, Any]:
    """SGLang's `internal_states[0]` from plait's server info (settings + scheduler facts + counters)."""
    state: dict[str, Any] = {k: v for k, v in info.items() if not isinstance(v, dict)}
    state["world_size"] = 1
    if startup_s is not None:
        state["startup_time"] = round(startup_s, 3)
    if info.get("max_running_requests") is not None:
        state["effective_max_running_requests_per_dp"] = info["max_running_requests"]
    decode = (info.get("steps") or {}).get("decode") or {}
    if decode.get("wall_s"):
        state["last_gen_throughput"] = round(decode.get("tokens", 0) / decode["wall_s"], 3)
    memory: dict[str, Any] = {}
    if info.get("max_total_tokens") is not None:
        memory["token_capacity"] = int(info["max_total_tokens"])
    for ours, theirs in (("kv_cache_bytes", "kvcache"), ("weight_bytes", "weight")):
        if info.get(ours) is not None:
            memory[theirs] = round(info[ours] / _GB, 2)
    state["memory_usage"] = memory
    if (info.get("spec_verify_steps") or 0) > 0 and info.get("avg_spec_accept_length") is not None:
        state["avg_spec_accept_length"] = info["avg_spec_accept_length"]
    else:  # SGLang leaves it out when speculation is off (plait's scheduler reports 0.0 then)
        state.pop("avg_spec_accept_length", None)
    return state
