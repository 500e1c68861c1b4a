"""SIGTERM on a real server: readiness false and new requests 503 at once, in-flight work finishes, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.gateway.conftest import start_server, stop_server


def test_sigterm_drains(tmp_path: Path) -> None:
    server = start_server(tmp_path, {"limits": {"drain_timeout_s": 30}})
    try:
        raw: list[str] = []
        started = threading.Event()

        def long_stream() -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 60,
                "temperature": 0,
                "stream": True,
                "speculative": {"mode": "off"},
            }
            with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    raw.append(line)

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(server.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        r = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
        assert (
            r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "server_error"
        )
        t.join(60)
        data = [line[6:] for line in raw if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] in ("length", "stop")  # finished, not cut
        assert server.proc.wait(30) == 0
    finally:
        stop_server(server)
