"""The server fuzzer's machinery (tests/server/test_server_fuzz.py runs it): a raw-socket HTTP client, seeded
random cases over every route, what every reply must be, and the server's process read from /proc.

Requests go out over a raw socket (`raw_request`) so the fuzzer can send what no HTTP library would:
invalid UTF-8, lone surrogates, NaN, gzip'd and chunked bodies, HTTP/1.0, half a body then a hang-up.
Run by hand against a running server: `python tests/helpers/server_fuzzer.py http://127.0.0.1:PORT --cases 500`.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import urlparse

SEED = 20261201
NUM_CASES = 300
MAX_NEW = 2  # tokens per generation: the model is slow on the CPU
RESPONSE_TIMEOUT_S = 60.0  # a response slower than this is a hang (the slowest legit case is ~1 s)


# ---------------------------------------------------------------- a raw HTTP client


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _dechunk(data: bytes) -> bytes:
    out, pos = b"", 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return out
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


def raw_request(
    url: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Optional[dict[str, str]] = None,
    version: str = "HTTP/1.1",
    chunked: bool = False,
    timeout: float = RESPONSE_TIMEOUT_S,
) -> Reply:
    """Send one request exactly as given (Connection: close) and read the whole response."""
    u = urlparse(url)
    head = {"Host": f"{u.hostname}:{u.port}", "Connection": "close", **(headers or {})}
    if chunked:
        head["Transfer-Encoding"] = "chunked"
        pieces = [body[i : i + 1000] for i in range(0, len(body), 1000)]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        if body or method in ("POST", "PUT", "PATCH"):
            head.setdefault("Content-Length", str(len(body)))
        payload = body
    lines = [f"{method} {path} {version}"] + [f"{k}: {v}" for k, v in head.items()]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            got = sock.recv(65536)
            if not got:
                break
            chunks.append(got)
    raw = b"".join(chunks)
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    reply_headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        reply_headers[k.strip().lower()] = v.strip()
    if reply_headers.get("transfer-encoding") == "chunked" and method != "HEAD":
        rest = _dechunk(rest)
    return Reply(int(status_line.split()[1]), reply_headers, rest)


# ---------------------------------------------------------------- what the fuzzer throws


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Raw JSON fragments (not all of them JSON that Python would write): spliced in as a field's value.
WEIRD_VALUES: list[bytes] = [
    b"null",
    b"true",
    b"false",
    b"0",
    b"-1",
    b"-2147483649",
    b"1e400",
    b"-1e400",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1.5",
    b"99999999999999999999999999999999",
    b"18446744073709551616",
    b"9223372036854775808",
    b"-9223372036854775809",
    b'""',
    b'"x"',
    b'"\\ud800"',
    b'"a\\udfffb"',
    b'"\\u0000"',
    b'"5"',
    b"[]",
    b"[null]",
    b"[[]]",
    b'[1, "a", null]',
    b"{}",
    b'{"": null}',
    b'{"a": {"b": []}}',
    b"[-1]",
    b"[99999999999999999999]",
    b'["\\ud800"]',
    b'{"1": NaN}',
    b'{"99999999999999999999": 1}',
]


# A 1 MB constraint compiles for minutes on the grammar backend's one thread (see the report in the commit):
# slow, and bounded by grammar_compile_timeout, so not sent where it becomes a constraint.
CONSTRAINT_FIELDS = {"regex", "ebnf", "json_schema", "response_format", "parameters", "tools", "tool_choice"}


def weird_value(rng: random.Random, huge: bool = True) -> bytes:
    pick = rng.random()
    if pick < 0.06 and huge:
        return b'"' + b"a" * (1 << 20) + b'"'  # 1 MB string
    if pick < 0.10:
        return _deep(rng.choice([64, 1000, 50_000]))
    if pick < 0.14:
        return b'"' + bytes([0xFF, 0xFE, 0xC3]) + b'"'  # invalid UTF-8 inside a string
    if pick < 0.18:
        return json.dumps([rng.randint(-2, 60_000) for _ in range(rng.randint(1, 5))]).encode()
    return rng.choice(WEIRD_VALUES)


# Bodies that work (MAX_NEW tokens at most); the fuzzer breaks one thing in each.
def chat_body(**extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_NEW, **extra}


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ALL_SAMPLING_PARAMS = {
    "max_new_tokens": MAX_NEW,
    "min_new_tokens": 0,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "repetition_penalty": 1.1,
    "stop": ["xyz"],
    "stop_token_ids": [5],
    "stop_regex": "zz+",
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "seed": 1,
    "logit_bias": {"5": 0.5},
    "json_whitespace": False,
    "custom_params": {"a": 1},
}
VALID_BODIES: list[tuple[str, dict]] = [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": MAX_NEW}, "stream": True}),
    (
        "/generate",
        {
            "text": ["a", "b"],
            "sampling_params": {"max_new_tokens": MAX_NEW, "n": 2},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    ),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_NEW, "temperature": 0.5, "logprobs": 1}),
    (
        "/v1/completions",
        {"prompt": [[1, 2], [3]], "max_tokens": MAX_NEW, "stream": True, "stream_options": {"include_usage": True}},
    ),
    ("/v1/chat/completions", chat_body(temperature=0, stop=["\n"], seed=3)),
    ("/v1/chat/completions", chat_body(stream=True, logprobs=True, top_logprobs=2)),
    ("/v1/chat/completions", chat_body(tools=[TOOL], tool_choice="auto")),
    (
        "/v1/chat/completions",
        chat_body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    ),
    (
        "/v1/chat/completions",
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}),
    ),
    ("/v1/chat/completions", chat_body(response_format={"type": "json_object"}, logit_bias={"42": 1.0})),
    ("/generate", {"text": "Hi", "sampling_params": ALL_SAMPLING_PARAMS}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": MAX_NEW, "regex": "[a-z]+"}}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": MAX_NEW, "json_schema": json.dumps(SCHEMA)}}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": MAX_NEW, "ebnf": 'root ::= "a" | "b"'}}),
    (
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": MAX_NEW,
            "regex": "[0-9]+",
            "stop_token_ids": [5],
            "top_k": 3,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "ignore_eos": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [TOOL],
            "max_tokens": MAX_NEW,
            "chat_template_kwargs": {"x": 1},
        },
    ),
    ("/abort_request", {"rid": "no-such-request"}),
    ("/pin_prefix", {"text": "pin me"}),
    ("/unpin_prefix", {"pin_id": 123456}),
]
# Fields left alone: without them a request generates for many seconds (the default max_tokens is 128 on
# /generate, the whole context on chat), which is slow, not wrong.
PROTECTED = {"max_tokens", "max_new_tokens", "sampling_params"}
GET_ROUTES = [
    "/health",
    "/health_generate",
    "/metrics",
    "/get_server_info",
    "/server_info",
    "/get_model_info",
    "/model_info",
    "/v1/models",
    "/v1/models/default",
    "/v1/models/nope",
    "/flush_cache",
]
ODD_PATHS = [
    "/",
    "/nope",
    "/v1",
    "/v1/embeddings",
    "/v1/chat",
    "/generate/",
    "//generate",
    "/%00",
    "/..%2f..%2fetc%2fpasswd",
    "/" + "x" * 5000,
    "/generate?stream=true",
    "/v1/models/%ff%fe",
    "/v1/models/" + "\u00e9".encode().decode("latin-1"),
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "",
    "*/*",
]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON value (dict keys and list indexes)."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if k not in PROTECTED:  # what is inside a protected field is fuzzed all the same
            out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


_HOLE = "\u0000HOLE\u0000"


def _splice(body: dict, path: tuple, raw: bytes) -> bytes:
    """The body with the value at `path` replaced by raw JSON bytes (which json.dumps could not write)."""
    obj = json.loads(json.dumps(body))
    target = obj
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = _HOLE
    return json.dumps(obj).encode().replace(json.dumps(_HOLE).encode(), raw)


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    version: str = "HTTP/1.1"
    chunked: bool = False


def make_case(rng: random.Random, i: int) -> Case:
    kind = rng.random()
    path, valid = rng.choice(VALID_BODIES)
    json_ct = {"Content-Type": "application/json"}
    if kind < 0.40:  # one field replaced by a weird value
        where = rng.choice(_paths(valid))
        raw = weird_value(rng, huge=not CONSTRAINT_FIELDS & set(map(str, where)))
        return Case(
            f"{i}:field {path} {'.'.join(map(str, where))}={raw[:40]!r}",
            "POST",
            path,
            _splice(valid, where, raw),
            json_ct,
        )
    if kind < 0.50:  # a field dropped, or an extra one added
        body = json.loads(json.dumps(valid))
        if rng.random() < 0.5 and (paths := [p for p in _paths(body) if len(p) == 1]):
            where = rng.choice(paths)
            del body[where[0]]
            return Case(f"{i}:drop {path} {where[0]}", "POST", path, json.dumps(body).encode(), json_ct)
        name = rng.choice(["extra", "temperature", "image_data", "lora_path", "__proto__", "", "\u00e9"])
        return Case(
            f"{i}:extra {path} {name!r}", "POST", path, _splice({**body, name: 0}, (name,), weird_value(rng)), json_ct
        )
    if kind < 0.62:  # a whole body that is not what the route wants
        raw = rng.choice(
            [
                b"",
                b"{",
                b"nul",
                b"[]",
                b'"text"',
                b"42",
                b'{"text": "hi"}}',
                b"\xff\xfe{}",
                bytes(rng.randrange(256) for _ in range(64)),
                b'{"text": "\xc3"}',
                _deep(100_000),
                b'{"a":' * 5000,
                json.dumps(valid).encode()[:-3],
                b"text=hi&x=1",
                b'{"text": "hi", "text": 5}',
                weird_value(rng),
            ]
        )
        return Case(f"{i}:body {path} {raw[:40]!r}", "POST", path, raw, json_ct)
    if kind < 0.72:  # a valid body sent oddly: content type, gzip, chunked, HTTP/1.0
        body = json.dumps(valid).encode()
        how = rng.choice(["ctype", "gzip", "gzip-lie", "chunked", "http10", "bad-length"])
        headers: dict[str, str] = {"Content-Type": rng.choice(CONTENT_TYPES)} if how == "ctype" else dict(json_ct)
        case = Case(f"{i}:{how} {path} {headers.get('Content-Type', '')}", "POST", path, body, headers)
        if how == "gzip":
            case.body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        elif how == "gzip-lie":
            headers["Content-Encoding"] = "gzip"
        elif how == "chunked":
            case.chunked = True
        elif how == "http10":
            case.version = "HTTP/1.0"
        elif how == "bad-length":
            headers["Content-Length"] = rng.choice(["-1", "abc", "99999999999999999999", str(len(body) - 5)])
        return case
    if kind < 0.90:  # any method on any route
        route = rng.choice(GET_ROUTES + [p for p, _ in VALID_BODIES] + ODD_PATHS)
        method = rng.choice(METHODS)
        body = json.dumps(valid).encode() if method in ("POST", "PUT", "PATCH") else b""
        return Case(f"{i}:{method} {route[:60]}", method, route, body, json_ct)
    # a query string or header that is odd
    headers = dict(json_ct)
    headers[rng.choice(["X-Request-Id", "Authorization", "Accept", "Accept-Encoding", "X-Long"])] = rng.choice(
        ["", "\u00e9\u00ff", "Bearer", "x" * 8000, "gzip;q=1, identity;q=0"]
    )
    return Case(f"{i}:header {path}", "POST", path, json.dumps(valid).encode(), headers)


# ---------------------------------------------------------------- what every response must be


def check_reply(case: Case, reply: Reply) -> Optional[str]:
    """None if the reply is acceptable, else what is wrong with it."""
    if reply.status >= 500:
        return f"status {reply.status}: {reply.body[:300]!r}"
    if case.method == "HEAD":
        return None  # no body by definition
    if reply.status >= 400:
        try:
            message = reply.json()["error"]["message"]
        except Exception:
            return f"status {reply.status} without a JSON error body: {reply.body[:300]!r}"
        if not isinstance(message, str) or not message:
            return f"empty error message: {reply.body[:300]!r}"
        return None
    ctype = reply.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in reply.body.decode().split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream not ended by [DONE]: {reply.body[-300:]!r}"
        for event in events[:-1]:
            obj = json.loads(event)
            if "error" in obj and obj["error"].get("code", 400) >= 500:
                return f"in-stream error {obj['error']}"
        return None
    if ctype.startswith("application/json"):
        try:
            reply.json()
        except Exception:
            return f"200 with a broken JSON body: {reply.body[:300]!r}"
    return None


# What a generated body may ask for at most: generation stays a few tokens (the model is slow on the CPU).
GENERATION_CAPS = {
    "max_tokens": MAX_NEW,
    "max_new_tokens": MAX_NEW,
    "max_completion_tokens": MAX_NEW,
    "max_output_tokens": MAX_NEW,
    "n": 2,
    "top_logprobs_num": 2,
    "min_tokens": 1,
    "min_new_tokens": 1,
}
# The length field each generation route reads (absent, chat generates to the end of the context).
LENGTH_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def cap_generation(path: str, body: Any) -> None:
    """Cap, in place, the fields of a generated request body that set how much it generates (also inside
    sampling_params), and set them where absent: a valid max_tokens of 5,000 is slow, not wrong. Values of
    the wrong type stay (they are what a fuzzer is for)."""
    if not isinstance(body, dict):
        return
    if path in LENGTH_FIELD and "max_completion_tokens" not in body:
        body.setdefault(LENGTH_FIELD[path], MAX_NEW)
    params = body.get("sampling_params")
    if path == "/generate" and params is None:
        params = body["sampling_params"] = {"max_new_tokens": MAX_NEW}
    for obj in [body] + (params if isinstance(params, list) else [params]):
        if not isinstance(obj, dict):
            continue
        if obj is not body:
            obj.setdefault("max_new_tokens", MAX_NEW)
        for name, cap in GENERATION_CAPS.items():
            value = obj.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                obj[name] = cap


def error_body_problem(body: Any, status: int, content_type: str, content: bytes) -> Optional[str]:
    """For a 4xx: what is wrong with its body (None if it is plait's JSON error, and any `param` it names is a
    field of the request, or one the message says is missing)."""
    if not 400 <= status < 500:
        return None
    try:
        error = json.loads(content)["error"]
    except Exception:
        return f"status {status} without a JSON error body ({content_type}): {content[:300]!r}"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return f"empty error message: {content[:300]!r}"
    param = error.get("param")
    if (
        param is not None
        and isinstance(body, dict)
        and param not in body
        and status == 400
        and f"'{param}'" not in error["message"]
    ):  # (a field that is missing is named in the message)
        return f"the error's param is {param!r}, which the request does not have: {error['message']}"
    return None


def canary(url: str) -> Optional[str]:
    """A normal request: it must succeed after every case."""
    try:
        reply = raw_request(
            url,
            "POST",
            "/generate",
            json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode(),
            {"Content-Type": "application/json"},
        )
    except OSError as e:
        return f"canary failed: {type(e).__name__}: {e}"
    if reply.status != 200 or reply.json()["meta_info"]["completion_tokens"] != 1:
        return f"canary got {reply.status}: {reply.body[:300]!r}"
    return None


def run_cases(url: str, seed: int, num_cases: int, log: Callable[[str], None] = lambda s: None) -> list[str]:
    rng = random.Random(seed)
    failures = []
    for i in range(num_cases):
        case = make_case(rng, i)
        try:
            reply = raw_request(url, case.method, case.path, case.body, case.headers, case.version, case.chunked)
            problem = check_reply(case, reply)
        except (OSError, ValueError, IndexError) as e:
            problem = f"no valid response: {type(e).__name__}: {e}"
        if problem:
            failures.append(f"{case.name}: {problem}")
            log(failures[-1])
        if (problem := canary(url)) is not None:
            failures.append(f"after {case.name}: {problem}")
            log(failures[-1])
    return failures


# ---------------------------------------------------------------- the server's process, from outside


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


def resources(pid: int) -> dict[str, float]:
    st = _proc_status(pid)
    return {"rss_mb": st["VmRSS"] / 1024, "threads": st["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def post_json(url: str, path: str, body: Any, **kw: Any) -> Reply:
    return raw_request(url, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}, **kw)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--cases", type=int, default=NUM_CASES)
    a = ap.parse_args()
    t0 = time.time()
    found = run_cases(a.url, a.seed, a.cases, log=print)
    print(f"{len(found)} failures in {a.cases} cases, {time.time() - t0:.1f} s")
