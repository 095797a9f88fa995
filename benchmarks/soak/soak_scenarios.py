"""The client mix of benchmarks/soak/soak_server.py: scenarios a real user sends, through real clients.

Each scenario takes a random.Random, talks to the server with the `openai` client, `requests` or
`aiohttp`, raises on a wrong answer and returns an outcome label ("ok" when it returns None). `Soak`
runs them from worker threads and can pause them to let the server go idle (`idle_check`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import requests

INFO_KEYS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "kv_used_tokens",
    "free_tokens",
    "evictable_tokens",
    "protected_tokens",
    "max_total_tokens",
    "integrity_errors",
    "last_integrity_error",
    "num_finished",
    "num_retractions",
    "num_open_http_requests",
)

# ---------------------------------------------------------------- workload text

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
FIXED_SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["tags"],
    },
]
REGEXES = [r"[0-9]{1,4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"\d{3}-\d{4}"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prefix(k: int, n_words: int) -> str:
    """One of a few long system prompts that many requests share (radix cache hits and evictions)."""
    return f"Document {k}: " + words(random.Random(k), n_words) + "\n"


# ---------------------------------------------------------------- the run's bookkeeping


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)  # "scenario:outcome" → count
    failures: list = field(default_factory=list)  # (time, scenario, message), first 50
    latencies: dict = field(default_factory=dict)

    def add(self, scenario: str, outcome: str, seconds: float = 0.0, message: str = "") -> None:
        with self.lock:
            self.outcomes[f"{scenario}:{outcome}"] += 1
            self.latencies.setdefault(scenario, []).append(seconds)
            if outcome == "FAIL" and len(self.failures) < 50:
                self.failures.append((round(time.time(), 1), scenario, message[:300]))


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        import openai

        self.url, self.args = url, args
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=args.request_timeout, max_retries=0)
        self.tally = Tally()
        self.paused = threading.Event()
        self.in_flight = 0
        self.in_flight_lock = threading.Lock()
        self.schema_counter = 0
        self.long_words = args.long_words
        info = requests.get(url + "/get_server_info", timeout=30).json()
        self.context_len, kv_tokens = info["context_len"], info["max_total_tokens"]
        # A prompt that fits the context but not the KV pool exists only when the pool is the smaller.
        self.kv_overflow_ids = kv_tokens + 1 if kv_tokens + 8 < self.context_len else None
        self.scenarios: list[tuple[str, float, Callable]] = [
            ("native_short", 3, self.native_short),
            ("native_stream", 2, self.native_stream),
            ("native_batch_n", 1, self.native_batch_n),
            ("openai_chat", 2, self.openai_chat),
            ("openai_chat_stream_n", 1, self.openai_chat_stream_n),
            ("openai_completion_long", 1, self.openai_long),
            ("prefix_shared", 3, self.prefix_shared),
            ("json_fixed", 2, self.json_fixed),
            ("json_new_schema", 4, self.json_new_schema),
            ("regex", 1, self.regex),
            ("drop_stream", 1, self.drop_stream),
            ("aiohttp_drop", 1, self.aiohttp_drop),
            ("abort_request", 1, self.abort_request),
            ("bad_request", 2, self.bad_request),
            ("hangup_at_once", 1, self.hangup_at_once),
        ]

    # ---- helpers
    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=self.args.request_timeout, **kw)

    def sp(self, rng: random.Random, **extra) -> dict:
        return {
            "max_new_tokens": rng.randint(4, self.args.max_new_tokens),
            "temperature": rng.choice([0, 0.7]),
            **extra,
        }

    @staticmethod
    def expect(cond: bool, message: str) -> None:
        if not cond:
            raise AssertionError(message)

    # ---- scenarios: each raises on a wrong answer, returns an outcome label
    def native_short(self, rng):
        r = self.post("/generate", {"text": "Q: " + words(rng, 8) + "\nA:", "sampling_params": self.sp(rng)})
        self.expect(
            r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length"),
            f"{r.status_code} {r.text[:200]}",
        )

    def native_stream(self, rng):
        with self.post(
            "/generate", {"text": words(rng, 20), "sampling_params": self.sp(rng), "stream": True}, stream=True
        ) as r:
            self.expect(r.status_code == 200, f"{r.status_code} {r.text[:200]}")
            lines = [ln for ln in r.iter_lines() if ln]
        self.expect(lines[-1] == b"data: [DONE]", f"stream did not end with [DONE]: {lines[-1][:200]!r}")
        self.expect(b'"finish_reason": {' in lines[-2], f"last chunk has no finish_reason: {lines[-2][:200]!r}")

    def native_batch_n(self, rng):
        sp = self.sp(rng, n=2, temperature=0.8)
        r = self.post("/generate", {"text": [words(rng, 6), words(rng, 12)], "sampling_params": sp})
        self.expect(r.status_code == 200 and len(r.json()) == 4, f"{r.status_code} {r.text[:200]}")

    def openai_chat(self, rng):
        out = self.client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": words(rng, 10)}],
            max_tokens=rng.randint(4, self.args.max_new_tokens),
            temperature=0.7,
            n=rng.choice([1, 2]),
        )
        self.expect(all(c.finish_reason in ("stop", "length") for c in out.choices), str(out)[:200])

    def openai_chat_stream_n(self, rng):
        stream = self.client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": words(rng, 10)}],
            max_tokens=rng.randint(4, self.args.max_new_tokens),
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        finished = {c.index for chunk in stream for c in chunk.choices if c.finish_reason}
        self.expect(finished == {0, 1}, f"choices finished: {finished}")

    def openai_long(self, rng):
        out = self.client.completions.create(
            model="default", prompt=words(rng, self.long_words), max_tokens=4, temperature=0
        )
        self.expect(out.usage.prompt_tokens > self.long_words // 2, str(out.usage))

    def prefix_shared(self, rng):
        prefix = shared_prefix(rng.randrange(self.args.num_prefixes), self.args.prefix_words)
        r = self.post("/generate", {"text": prefix + "Question: " + words(rng, 5), "sampling_params": self.sp(rng)})
        self.expect(r.status_code == 200, f"{r.status_code} {r.text[:200]}")

    def json_fixed(self, rng):
        schema = rng.choice(FIXED_SCHEMAS)
        out = self.client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Give JSON about " + words(rng, 3)}],
            max_tokens=48,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        if out.choices[0].finish_reason == "stop":  # a length cut leaves incomplete JSON, which is fine
            json.loads(out.choices[0].message.content)
        return out.choices[0].finish_reason

    def json_new_schema(self, rng):
        with self.in_flight_lock:
            self.schema_counter += 1
            k = self.schema_counter
        schema = {"type": "object", "properties": {f"field_{k}": {"type": "integer"}}, "required": [f"field_{k}"]}
        r = self.post(
            "/generate",
            {
                "text": "JSON: ",
                "sampling_params": {"max_new_tokens": 2, "temperature": 0, "json_schema": json.dumps(schema)},
            },
        )
        self.expect(r.status_code == 200, f"{r.status_code} {r.text[:200]}")

    def regex(self, rng):
        pattern = rng.choice(REGEXES)
        r = self.post("/generate", {"text": "Answer: ", "sampling_params": {"max_new_tokens": 12, "regex": pattern}})
        self.expect(r.status_code == 200, f"{r.status_code} {r.text[:200]}")
        meta = r.json()["meta_info"]
        if meta["finish_reason"]["type"] == "stop":
            self.expect(re.fullmatch(pattern, r.json()["text"]) is not None, f"{pattern} vs {r.json()['text']!r}")

    def drop_stream(self, rng):
        r = self.post(
            "/generate",
            {"text": words(rng, 10), "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
            stream=True,
        )
        self.expect(r.status_code == 200, f"{r.status_code}")
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
        r.close()  # the server must abort it, not decode 200 tokens for nobody

    def aiohttp_drop(self, rng):
        import aiohttp

        async def go():
            async with aiohttp.ClientSession() as s:
                body = {
                    "model": "default",
                    "prompt": words(rng, 15),
                    "max_tokens": 200,
                    "stream": True,
                    "ignore_eos": True,
                }
                async with s.post(self.url + "/v1/completions", json=body) as r:
                    self.expect(r.status == 200, f"{r.status}")
                    n = 0
                    async for _ in r.content:
                        n += 1
                        if n >= 3:
                            break

        asyncio.run(go())

    def hangup_at_once(self, rng):
        """A client that sends a request and is gone before any answer (a timeout, a killed process)."""
        import socket
        from urllib.parse import urlparse

        u = urlparse(self.url)
        body = json.dumps({"text": words(rng, 10), "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
        with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
            sock.sendall(
                f"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )

    def abort_request(self, rng):
        rid = f"soak-abort-{rng.getrandbits(48):x}"
        result: dict = {}

        def run():
            result["r"] = self.post(
                "/generate",
                {"text": words(rng, 10), "rid": rid, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
            )

        t = threading.Thread(target=run)
        t.start()
        time.sleep(rng.uniform(0.2, 2.0))
        a = self.post("/abort_request", {"rid": rid})
        self.expect(a.status_code == 200, f"abort {a.status_code} {a.text[:200]}")
        t.join(self.args.request_timeout)
        self.expect(not t.is_alive(), "the aborted request never returned")
        r = result["r"]
        self.expect(r.status_code == 200, f"{r.status_code} {r.text[:200]}")
        return r.json()["meta_info"]["finish_reason"]["type"]  # "abort" unless it had not reached the engine

    def bad_request(self, rng):
        kinds = ["schema", "context", "temperature", "regex", "max_tokens", "model", "n"]
        kind = rng.choice(kinds + (["kv"] if self.kv_overflow_ids else []))
        if kind == "schema":
            r = self.post("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "nope"}'}})
        elif kind == "context":
            r = self.post(
                "/v1/completions", {"model": "default", "prompt": " word" * (self.context_len + 50), "max_tokens": 4}
            )
        elif kind == "kv":  # fits the context, not the KV pool (when --max-total-tokens is small)
            r = self.post(
                "/generate",
                {
                    "input_ids": [rng.randrange(100, 5000) for _ in range(self.kv_overflow_ids)],
                    "sampling_params": {"max_new_tokens": 2},
                },
            )
        elif kind == "temperature":
            r = self.post("/generate", {"text": "x", "sampling_params": {"temperature": -1}})
        elif kind == "regex":
            r = self.post("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}})
        elif kind == "max_tokens":
            r = self.post(
                "/v1/chat/completions",
                {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            )
        elif kind == "model":
            r = self.post(
                "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
            )
        else:
            r = self.post("/v1/completions", {"model": "default", "prompt": "x", "n": 0})
        self.expect(400 <= r.status_code < 500 and "error" in r.json(), f"{kind}: {r.status_code} {r.text[:200]}")
        return f"{kind}-{r.status_code}"

    # ---- driving
    def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        names, weights, fns = zip(*self.scenarios)
        while time.time() < deadline:
            if self.paused.is_set():
                time.sleep(0.2)
                continue
            i = rng.choices(range(len(names)), weights=weights)[0]
            with self.in_flight_lock:
                self.in_flight += 1
            t0 = time.perf_counter()
            try:
                outcome = fns[i](rng) or "ok"
                self.tally.add(names[i], str(outcome), time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.tally.add(names[i], "FAIL", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
            finally:
                with self.in_flight_lock:
                    self.in_flight -= 1

    def idle_check(self, label: str, probe: Callable[[], dict] = dict) -> dict:
        """Pause the workers, wait for the server to go idle, flush the cache; the server info then,
        with `probe()` (process RSS, fds) taken while the server is still idle."""
        self.paused.set()
        try:
            while self.in_flight:
                time.sleep(0.2)
            deadline = time.time() + 60
            while True:
                info = requests.get(self.url + "/get_server_info", timeout=30).json()
                if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0) or time.time() > deadline:
                    break
                time.sleep(0.5)
            flush = requests.post(self.url + "/flush_cache", timeout=30)
            self.tally.add("flush_cache", "ok" if flush.status_code == 200 else "FAIL", 0.0, flush.text[:200])
            info = requests.get(self.url + "/get_server_info", timeout=30).json()
            return {"label": label, "flush_status": flush.status_code, **{k: info.get(k) for k in INFO_KEYS}, **probe()}
        finally:
            self.paused.clear()
