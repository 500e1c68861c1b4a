"""SIGTERM on a real server: readiness false and new requests 503 at once, in-flight work finishes, exit 0.

The request that keeps the server draining is a stream from a real upstream process that holds it
after its first event until the test releases it, so the checks made while draining do not race the
stream's end (a local tiny-model stream of any length can finish first on a fast machine).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.conftest import start_server, stop_server
from tests.router.conftest import FakeUpstream
from tests.servers import free_port


def _stream_into(
    url: str, body: dict[str, Any], raw: list[str], started: threading.Event
) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                raw.append(line)

    t = threading.Thread(target=run)
    t.start()
    return t


def _finished(raw: list[str]) -> dict[str, Any]:
    data = [line[6:] for line in raw if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last: dict[str, Any] = json.loads(data[-2])
    return last


def test_sigterm_drains(tmp_path: Path) -> None:
    upstream = FakeUpstream(free_port()).start()
    server = start_server(tmp_path, {
        "limits": {"drain_timeout_s": 60},
        "upstreams": [{"name": "held", "base_url": upstream.base_url, "model": "remote-model", "retries": 0}],
    })  # fmt: skip
    try:
        upstream.script([{"kind": "ok", "hold": True}])
        held_raw: list[str] = []
        held_started = threading.Event()
        body = {"model": "held", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        held = _stream_into(server.base_url + "/chat/completions", body, held_raw, held_started)
        local_raw: list[str] = []
        local_started = threading.Event()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                "temperature": 0, "stream": True}  # fmt: skip
        local = _stream_into(server.base_url + "/chat/completions", body, local_raw, local_started)
        assert held_started.wait(30) and local_started.wait(30)

        server.proc.send_signal(signal.SIGTERM)
        ready = None
        for _ in range(50):  # the handler sets draining on the signal; give the process a moment to take it
            ready = httpx.get(server.url + "/ready", timeout=5)
            if ready.status_code == 503:
                break
            threading.Event().wait(0.1)
        assert ready is not None and ready.status_code == 503 and ready.json()["reason"] == "draining"
        r = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
        assert (
            r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "server_error"
        )
        assert server.proc.poll() is None  # still serving the held stream

        upstream.release()
        held.join(60)
        local.join(60)
        assert _finished(held_raw)["choices"][0]["finish_reason"] == "stop"  # finished, not cut
        assert _finished(local_raw)["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.proc.wait(30) == 0
    finally:
        stop_server(server)
        upstream.kill()


def test_streams_cut_at_the_drain_timeout_end_with_an_error_event(tmp_path: Path) -> None:
    """A stream still running when the drain times out gets one OpenAI error event and [DONE],
    not a connection that just stops."""
    upstream = FakeUpstream(free_port()).start()
    server = start_server(tmp_path, {
        "limits": {"drain_timeout_s": 0.5},
        "upstreams": [{"name": "held", "base_url": upstream.base_url, "model": "remote-model", "retries": 0}],
    })  # fmt: skip
    try:
        upstream.script([{"kind": "ok", "hold": True}])  # never released
        raw: list[str] = []
        started = threading.Event()
        body = {"model": "held", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        held = _stream_into(server.base_url + "/chat/completions", body, raw, started)
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        held.join(60)
        data = [line[6:] for line in raw if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["type"] == "server_error" and err["code"] == "unavailable"
        assert set(err) == {"message", "type", "param", "code"}
        assert server.proc.wait(30) == 0
    finally:
        stop_server(server)
        upstream.kill()
