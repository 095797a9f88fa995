"""Hosted LLM APIs as real HTTP servers on localhost, speaking each provider's wire format, for the backends
that reach them through the official SDKs (the SDK itself is not patched: it sends real requests here).

`ProviderFake` answers Anthropic's Messages API (`POST /v1/messages`, whole or as its server-sent events) and
OpenAI's chat completions (`POST .../chat/completions`, Azure's deployment paths included) with `reply`,
and records every request (path with its query, headers lower-cased, JSON body).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROMPT_TOKENS, COMPLETION_TOKENS = 11, 3


class ProviderFake:
    def __init__(self, reply: str = "Paris") -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                fake.requests.append(
                    {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                )
                if self.path.split("?")[0].endswith("/v1/messages"):
                    fake._anthropic(self, body)
                elif self.path.split("?")[0].endswith("/chat/completions"):
                    fake._openai_chat(self, body)
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "ProviderFake":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, payload: dict) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    @staticmethod
    def _events(handler: BaseHTTPRequestHandler, events: list[tuple[str, dict]]) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("connection", "close")
        handler.end_headers()
        for name, payload in events:
            prefix = f"event: {name}\n" if name else ""
            handler.wfile.write(f"{prefix}data: {json.dumps(payload)}\n\n".encode())
        handler.wfile.flush()
        handler.close_connection = True

    def _anthropic(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        message = {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": self.reply}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": COMPLETION_TOKENS},
        }
        if not body.get("stream"):
            self._json(handler, message)
            return
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": 0},
        }
        half = len(self.reply) // 2
        events = [
            ("message_start", {"type": "message_start", "message": start}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
        ]
        for piece in (self.reply[:half], self.reply[half:]):
            delta = {"type": "text_delta", "text": piece}
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}))
        events += [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": COMPLETION_TOKENS},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        self._events(handler, events)

    def _openai_chat(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        }
        self._json(
            handler,
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": self.reply}, "finish_reason": "stop"}
                ],
                "usage": usage,
            },
        )
