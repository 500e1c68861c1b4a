"""A real fake upstream: tests/router/fake_upstream.py in its own uvicorn process on a free port."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port

FAKE = Path(__file__).with_name("fake_upstream.py")


class FakeUpstream:
    """Start, kill and restart the fake upstream process on one port."""

    def __init__(self, port: int):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FakeUpstream:
        self.proc = subprocess.Popen([sys.executable, str(FAKE), str(self.port)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"fake upstream exited with {self.proc.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=0.5).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"fake upstream did not start on port {self.port} within 15 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # SIGKILL: no graceful close, like a crashed or unplugged upstream
            self.proc.wait()
            self.proc = None

    def script(self, actions: list[dict[str, object]]) -> None:
        httpx.post(f"http://127.0.0.1:{self.port}/_script", json=actions, timeout=5).raise_for_status()

    def release(self) -> None:
        """Let a stream scripted with `"hold": true` go on."""
        httpx.post(f"http://127.0.0.1:{self.port}/_release", timeout=5).raise_for_status()

    def seen(self) -> list[dict[str, object]]:
        r = httpx.get(f"http://127.0.0.1:{self.port}/_seen", timeout=5)
        r.raise_for_status()
        out: list[dict[str, object]] = r.json()
        return out


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream(free_port()).start()
    yield fake
    fake.kill()


@pytest.fixture
def upstream_b() -> Iterator[FakeUpstream]:
    """A second upstream, per test: tests kill it."""
    fake = FakeUpstream(free_port()).start()
    yield fake
    fake.kill()
