"""Local servers for tests: a free port, and a redis-server of the tests' own (Debian's package,
never a stand-in)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Cache settings for tests whose subject is what Redis shares, not how a slow Redis is survived: the
# product's 50 ms budget per operation is a fallback under load, and on a busy 2-core CI machine the
# test suite itself is that load (a rate limit fell back to per-process buckets, a semantic lookup
# missed). Tests of the fallback keep the product's budget.
UNHURRIED_REDIS = {"timeout_ms": 2000.0, "connect_timeout_ms": 2000.0}


class RedisProcess:
    """A redis-server of our own on a free port, which tests may stop and start again."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


async def serve_in_loop(app: Any, **options: Any) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    """``app`` served by uvicorn on a free port in this event loop, once it listens: its URL, the
    server (``should_exit = True`` stops it) and the task to await after. ``options``: more of
    ``uvicorn.Config``'s (``http=``, the protocol class ``specgate serve`` uses)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{port}", server, task
