"""Writes plait-dashboard.json, the Grafana dashboard over plait's /metrics: `python deploy/grafana/build_dashboard.py`.

Edit the panels here, not in the JSON; tests/server/test_grafana_dashboard.py checks that the JSON is this script's
output and that it is valid for Grafana.
"""

import json
import os

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECT = '{model_name=~"$model"}'
WINDOW = "[$__rate_interval]"


def rate(metric: str) -> str:
    return f"sum(rate({metric}{SELECT}{WINDOW}))"


def quantiles(histogram: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SELECT}{WINDOW})))", f"p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


class Layout:
    """Panels placed row by row on Grafana's 24-column grid, numbered as they are added."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0

    def _add(self, panel: dict, x: int, w: int, h: int) -> None:
        self.panels.append({**panel, "id": len(self.panels) + 1, "gridPos": {"h": h, "w": w, "x": x, "y": self.y}})

    def row(self, title: str, height_below: int) -> None:
        if self.panels:
            self.y += self._row_height
        self._add({"type": "row", "title": title, "collapsed": False, "panels": []}, 0, 24, 1)
        self.y += 1
        self._row_height = height_below

    def timeseries(
        self,
        title: str,
        description: str,
        exprs: list[tuple[str, str]],
        unit: str,
        x: int,
        w: int = 8,
        maximum: float | None = None,
    ) -> None:
        defaults = {
            "unit": unit,
            "min": 0,
            "custom": {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 10,
                "showPoints": "never",
                "spanNulls": True,
            },
        }
        if maximum is not None:
            defaults["max"] = maximum
        self._add(
            {
                "type": "timeseries",
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "targets": [_target(expr, legend, chr(65 + i)) for i, (expr, legend) in enumerate(exprs)],
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                    "tooltip": {"mode": "multi", "sort": "none"},
                },
            },
            x,
            w,
            8,
        )

    def stat(self, title: str, description: str, expr: str, unit: str, x: int, maximum: float | None = None) -> None:
        defaults = {
            "unit": unit,
            "min": 0,
            "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
        }
        if maximum is not None:
            defaults["max"] = maximum
        self._add(
            {
                "type": "stat",
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "targets": [_target(expr, title, "A")],
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": {
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value",
                    "graphMode": "area",
                    "justifyMode": "auto",
                    "textMode": "auto",
                    "orientation": "auto",
                    "wideLayout": True,
                    "showPercentChange": False,
                    "percentChangeColorMode": "standard",
                },
            },
            x,
            6,
            4,
        )


def _target(expr: str, legend: str, ref: str) -> dict:
    return {
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "editorMode": "code",
        "datasource": DATASOURCE,
    }


def build() -> dict:
    g = Layout()
    window_hit_rate = f"{rate('plait_cached_tokens_total')} / {rate('plait_prompt_tokens_total')}"
    g.row("Now", 4)
    g.stat(
        "Running requests",
        "Requests in the scheduler's running batch",
        f"sum(plait_num_running_reqs{SELECT})",
        "short",
        0,
    )
    g.stat(
        "Queued requests",
        "Requests waiting in the scheduler's queue",
        f"sum(plait_num_queued_reqs{SELECT})",
        "short",
        6,
    )
    g.stat(
        "KV cache usage",
        "Share of KV cache slots held by requests (the prefix cache's evictable slots not counted)",
        f"max(plait_kv_cache_usage{SELECT})",
        "percentunit",
        12,
        maximum=1,
    )
    g.stat(
        "Prefix cache hit rate",
        "Prompt tokens served from the radix cache, over the window",
        window_hit_rate,
        "percentunit",
        18,
        maximum=1,
    )
    g.row("Throughput", 8)
    g.timeseries(
        "Tokens per second",
        "Generated tokens, prompt tokens, and prompt tokens the prefix cache served",
        [
            (rate("plait_generation_tokens_total"), "generated"),
            (rate("plait_prompt_tokens_total"), "prompt"),
            (rate("plait_cached_tokens_total"), "prompt, from the cache"),
        ],
        "short",
        0,
        w=12,
    )
    g.timeseries(
        "Requests per second",
        "Finished requests by finish reason, and requests refused with 503 (queue full)",
        [
            (f"sum by (finish_reason) (rate(plait_requests_total{SELECT}{WINDOW}))", "{{finish_reason}}"),
            (rate("plait_rejected_requests_total"), "rejected (503)"),
        ],
        "reqps",
        12,
        w=12,
    )
    g.row("Latency (measured at the HTTP server)", 8)
    g.timeseries(
        "Time to first token", "p50 / p90 / p99 over the window", quantiles("plait_time_to_first_token_seconds"), "s", 0
    )
    g.timeseries(
        "Inter-token latency", "p50 / p90 / p99 over the window", quantiles("plait_inter_token_latency_seconds"), "s", 8
    )
    g.timeseries(
        "End-to-end latency", "p50 / p90 / p99 over the window", quantiles("plait_e2e_request_latency_seconds"), "s", 16
    )
    g.row("Load and memory", 8)
    g.timeseries(
        "Requests",
        "Running in the batch, waiting in the scheduler's queue, and open at the HTTP server",
        [
            (f"sum(plait_num_running_reqs{SELECT})", "running"),
            (f"sum(plait_num_queued_reqs{SELECT})", "queued"),
            (f"sum(plait_num_in_flight_reqs{SELECT})", "open HTTP requests"),
        ],
        "short",
        0,
    )
    g.timeseries(
        "KV cache usage",
        "Share of KV slots held by requests",
        [(f"max(plait_kv_cache_usage{SELECT})", "used")],
        "percentunit",
        8,
        maximum=1,
    )
    g.timeseries(
        "Prefix cache hit rate",
        "Over the window, and since the server started",
        [(window_hit_rate, "window"), (f"max(plait_cache_hit_rate{SELECT})", "since start")],
        "percentunit",
        16,
        maximum=1,
    )
    g.row("Constraints and speculation", 8)
    hits, misses = rate("plait_grammar_cache_hits_total"), rate("plait_grammar_cache_misses_total")
    g.timeseries(
        "Grammar compile time",
        "Mean seconds per compiled grammar (cache misses), and the grammar cache's "
        "hit ratio (no compile time until the grammar backend reports it)",
        [
            (f"{rate('plait_grammar_compile_seconds_total')} / {misses}", "mean compile seconds"),
            (f"{hits} / ({hits} + {misses})", "cache hit ratio"),
        ],
        "short",
        0,
    )
    g.timeseries(
        "Tokens a grammar forced",
        "Appended by jump-forward without a decode step, per second",
        [(rate("plait_jump_forward_tokens_total"), "jump-forward tokens")],
        "short",
        8,
    )
    g.timeseries(
        "Speculative accept length",
        "Tokens accepted per speculative verify step, over the window and "
        "since the start (no data without speculation)",
        [
            (f"{rate('plait_spec_accepted_tokens_total')} / {rate('plait_spec_verify_steps_total')}", "window"),
            (f"max(plait_spec_accept_length{SELECT})", "since start"),
        ],
        "short",
        16,
    )
    g.row("Hierarchical cache (host tier; no data without --enable-hierarchical-cache)", 8)
    g.timeseries(
        "Host tier usage",
        "Share of the host tier's slots holding prefixes evicted from (or written through from) the device",
        [(f"max(plait_hicache_host_usage{SELECT})", "used")],
        "percentunit",
        0,
        maximum=1,
    )
    g.timeseries(
        "Tokens loaded back",
        "Cached prompt tokens a match brought back from the host tier, per second",
        [(rate("plait_hicache_loaded_tokens_total"), "loaded back")],
        "short",
        8,
    )
    g.timeseries(
        "Host tier traffic",
        "K/V bytes per second copied each way between the device pool and the host tier",
        [
            (rate("plait_hicache_bytes_to_host_total"), "to host"),
            (rate("plait_hicache_bytes_to_device_total"), "to device"),
        ],
        "Bps",
        16,
    )
    return {
        "uid": "plait-serving",
        "title": "plait serving",
        "description": "One plait server's /metrics: throughput, latency percentiles, load, KV and prefix cache, "
        "constraints, speculation, the host tier.",
        "tags": ["plait", "llm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Prometheus",
                    "query": "prometheus",
                    "hide": 0,
                    "current": {"text": "Prometheus", "value": "prometheus"},
                    "options": [],
                    "refresh": 1,
                },
                {
                    "type": "query",
                    "name": "model",
                    "label": "Model",
                    "datasource": DATASOURCE,
                    "query": "label_values(plait_requests_total, model_name)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "options": [],
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": g.panels,
        "links": [],
    }


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plait-dashboard.json")
    dashboard = build()
    with open(path, "w") as f:
        json.dump(dashboard, f, indent=2)
        f.write("\n")
    print(f"{path}: {len(dashboard['panels'])} panels")
