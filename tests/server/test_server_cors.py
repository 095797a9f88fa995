"""CORS (`--allowed-origins`) through the real FastAPI app, before the Engine (no model needed): off by default;
with a list or `*`, preflights answered for allowed origins (a JSON 403 for others) and the allowed origin on
every response, a 401 included, so a web page can read why."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from plait.runtime.server import create_app
from plait.runtime.server_args import ServerArgs
from test_server_protocol import EngineThatMustNotBeCalled

APP = "https://app.example"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def client_for(**server_args) -> TestClient:
    return TestClient(create_app(EngineThatMustNotBeCalled(), ServerArgs(**server_args)))


def test_no_cors_by_default():
    client = client_for()
    r = client.get("/health", headers={"Origin": APP})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert "method not allowed" in r.json()["error"]["message"]


def test_allowed_origins_get_preflights_and_headers_others_do_not():
    client = client_for(allowed_origins=[APP, "http://localhost:3000"], api_key="k")
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == APP
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in r.headers["access-control-allow-methods"] and r.headers["vary"] == "Origin"
    r = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.status_code == 403 and "not allowed" in r.json()["error"]["message"]
    assert "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"Origin": APP, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = client.get("/v1/models", headers={"Origin": APP})  # no key: the page can read the 401 and its reason
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
    r = client.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_any_origin():
    client = client_for(allowed_origins=["*"])
    r = client.options("/generate", headers={**PREFLIGHT, "Origin": "https://anything.example"})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    assert client.get("/health", headers={"Origin": "null"}).headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("value", [["app.example"], ["https://app.example/path"], ["ftp://x"], [5]])
def test_an_origin_that_is_not_one_is_refused_by_name(value):
    with pytest.raises(ValueError, match="allowed_origins"):
        ServerArgs(allowed_origins=value)
    assert ServerArgs(allowed_origins="https://a.example, http://b.example:8080/").allowed_origins == [
        "https://a.example",
        "http://b.example:8080",
    ]
