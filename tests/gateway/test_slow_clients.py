"""Slow and idle uploads against a real server: the head and the body have deadlines, answered in
OpenAI's error shape, and an upload still arriving at SIGTERM neither holds the drain nor ends in a
plain-text 500."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Server, start_server, stop_server

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
BODY = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("strict"),
        {"server": {"header_timeout_s": 1, "body_timeout_s": 1}, "cache": {"enabled": False}},
    )
    yield s
    stop_server(s)


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)  # a guard against a hang, not a timing
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read until the server closes the connection: status, headers, body."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _assert_openai_error(headers: dict[str, str], body: bytes, code: str) -> None:
    assert headers["content-type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code


def _in_flight(server: Server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('specgate_requests_in_flight{route="/v1/chat/completions"}'):
            return float(line.split()[-1])
    return 0.0


def test_headers_sent_a_byte_at_a_time_get_408(strict: Server) -> None:
    with _connect(strict) as sock:
        for byte in HEAD[:20]:  # a slowloris: bytes keep coming, the head never completes in time
            try:
                sock.send(bytes([byte]))
            except OSError:
                break  # the server hung up
            time.sleep(0.1)
        status, headers, body = _answer(sock)
    assert status == 408
    _assert_openai_error(headers, body, "request_timeout")
    assert httpx.get(strict.url + "/health", timeout=10).status_code == 200


def test_a_stalled_body_gets_408_and_leaves_no_request_in_flight(strict: Server) -> None:
    with _connect(strict) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10])
        status, headers, body = _answer(sock)
    assert status == 408 and headers["x-request-id"] and headers["connection"] == "close"
    _assert_openai_error(headers, body, "request_timeout")
    assert _in_flight(strict) == 0
    r = httpx.post(strict.base_url + "/chat/completions", content=BODY, timeout=60)
    assert r.status_code == 200  # a client at ordinary speed is served


def test_sigterm_with_an_idle_upload(tmp_path: Path) -> None:
    """The drain must not wait for a body that may never come: the upload gets a 503 in OpenAI's
    shape at once, and the server exits 0 without an 'Exception in ASGI application'."""
    server = start_server(
        tmp_path,
        {
            "server": {"body_timeout_s": 600},  # so the drain, not the body deadline, ends it
            "limits": {"drain_timeout_s": 600},
            "cache": {"enabled": False},
        },
    )
    try:
        with _connect(server) as sock:
            sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10])
            while _in_flight(server) < 1:  # the app is waiting for the rest of the body
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            status, headers, body = _answer(sock)
        assert status == 503 and headers["retry-after"]
        _assert_openai_error(headers, body, "unavailable")
        assert server.proc.wait(60) == 0
        assert "Exception in ASGI application" not in server.output()
    finally:
        stop_server(server)
