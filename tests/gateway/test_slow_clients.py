"""Slow and idle uploads against a real server: the head and the body have deadlines, answered in
OpenAI's error shape, an upload still arriving at SIGTERM neither holds the drain nor ends in a
plain-text 500, and a connection answered before its body arrived is closed, not held by a client
that sends a byte now and then (issue 48)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.server import timed_h11
from tests.gateway.conftest import Server, start_server, stop_server
from tests.servers import serve_in_loop

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


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Keys on, and deadlines far beyond the tests' guards: a connection closed within a guard was
    closed for the answer, not by a deadline."""
    s = start_server(
        tmp_path_factory.mktemp("keyed"),
        {"server": {"header_timeout_s": 600, "body_timeout_s": 600}, "cache": {"enabled": False}},
        env={"SPECGATE_API_KEYS": "sk-a"},
    )
    yield s
    stop_server(s)


def _connect(server: Server | str) -> socket.socket:
    url = server if isinstance(server, str) else server.url
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)  # a guard against a hang, not a timing
    return sock


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read until the server closes the connection: status, headers, body."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    return _parse(raw)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (its Content-Length's worth of body), the connection left as it is."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += (chunk := sock.recv(65536))
        assert chunk, f"closed before a response: {raw!r}"
    status, headers, body = _parse(raw)
    while len(body) < int(headers["content-length"]):
        body += (chunk := sock.recv(65536))
        assert chunk, "closed mid-response"
    return status, headers, body


def _closed(sock: socket.socket) -> bool:
    """Whether the server closes the connection (anything still sent is read first) within the
    socket's timeout: a guard against a hang, not a timing."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:  # closed, and the byte sent after that was answered with a reset
        return True
    except TimeoutError:
        return False
    return True


def _one_more_byte(sock: socket.socket) -> None:
    """The issue's client: after the answer, one more byte of the body it never finished."""
    with contextlib.suppress(OSError):  # the server closed the connection already
        sock.sendall(b"x")


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


MEGABYTE = b"Content-Length: 1000000\r\n\r\n{"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (HEAD + MEGABYTE, 401),  # no key
        (HEAD.replace(b"/chat/completions", b"/nothing") + b"Authorization: Bearer sk-a\r\n" + MEGABYTE, 404),
        (HEAD + b"Authorization: Bearer sk-a\r\nContent-Length: 2000000\r\n\r\n{", 413),
        # refused while reading: a chunk larger than the limit, more than the limit of it sent
        (
            HEAD
            + b"Authorization: Bearer sk-a\r\nTransfer-Encoding: chunked\r\n\r\n1e8480\r\n"
            + b"{" * 1_100_000,
            413,
        ),
        (b"GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sk-a\r\n" + MEGABYTE, 200),
    ],
    ids=["401", "404", "413", "413-counted", "GET-with-a-body"],
)
def test_a_connection_answered_before_its_body_arrived_is_closed(
    keyed: Server, head: bytes, status: int
) -> None:
    """uvicorn kept such a connection alive and dropped the body's further bytes unread, and the
    first of them cancelled its keep-alive timer for good: one more byte held it open."""
    with _connect(keyed) as sock:
        sock.settimeout(30)
        sock.sendall(head)
        got, headers, _ = _response(sock)
        assert got == status and headers["connection"] == "close"
        _one_more_byte(sock)
        assert _closed(sock), "the connection was held open after its answer"
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts descriptors in /proc")
def test_held_connections_do_not_pile_up(keyed: Server) -> None:
    """The issue's 3,000 connections without a key, each answered 401 and sent one more byte: the
    server closed every one (the client still holding its end), and its descriptors came back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3000 + 256  # the client's ends, and what this process holds already
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    before = _open_fds(keyed.proc.pid)
    socks = []
    try:
        for _ in range(3000):
            sock = _connect(keyed)
            socks.append(sock)
            sock.settimeout(30)
            sock.sendall(HEAD + MEGABYTE)
            assert _response(sock)[0] == 401
            _one_more_byte(sock)
        assert all(_closed(sock) for sock in socks)
        # a bound for descriptors the server opens meanwhile (its logs, a scrape), not 3,000 sockets
        assert _open_fds(keyed.proc.pid) <= before + 50
    finally:
        for sock in socks:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _early_401(scope: Scope, receive: Receive, send: Send) -> None:
    """An app that answers without reading the body, and without saying Connection: close."""
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"no"})


async def _read_then_200(scope: Scope, receive: Receive, send: Send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _early_answer_then_one_more_byte(url: str) -> tuple[int, bool]:
    with _connect(url) as sock:
        sock.settimeout(30)
        sock.sendall(HEAD + MEGABYTE)
        status = _response(sock)[0]
        _one_more_byte(sock)
        return status, _closed(sock)


def _two_requests_on_one_connection(url: str) -> list[int]:
    with _connect(url) as sock:
        sock.settimeout(30)
        statuses = []
        for _ in range(2):
            sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
            status, headers, _ = _response(sock)
            assert "connection" not in headers
            statuses.append(status)
        return statuses


async def test_the_protocol_closes_after_any_answer_given_before_the_body() -> None:
    """``TimedH11Protocol`` closes the connection even when the app did not say so; a request whose
    body arrived whole keeps its connection for the next one."""
    url, server, task = await serve_in_loop(_early_401, http=timed_h11(600), lifespan="off")
    try:
        assert await asyncio.to_thread(_early_answer_then_one_more_byte, url) == (401, True)
    finally:
        server.should_exit = True
        await task
    url, server, task = await serve_in_loop(_read_then_200, http=timed_h11(600), lifespan="off")
    try:
        assert await asyncio.to_thread(_two_requests_on_one_connection, url) == [200, 200]
    finally:
        server.should_exit = True
        await task
