"""/dashboard in headless Chromium against a real server: the charts render, checked on a screenshot.

The page writes each canvas's rectangle and the number of points it drew into ``data-*`` attributes;
``--dump-dom`` reads those, ``--screenshot`` (same window size, scale 1) gives the pixels, and each
chart's rectangle must hold its series colours. Traffic runs while the page polls, so rates move.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.observability.conftest import Served, serve, stop

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PALETTE = [(0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B), (0xE1, 0x57, 0x59), (0x76, 0xB7, 0xB2)]
WINDOW = (1280, 1100)
# Charts that must show data after local generations (cache and route mix need those subsystems).
WITH_DATA = {"req", "ttft", "tps", "acc", "aps", "spec", "err"}

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = serve(tmp_path_factory.mktemp("dash"), {})
    yield s
    stop(s)


def _traffic(url: str, stop_at: threading.Event) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello hello hello"}], "max_tokens": 12}
    with httpx.Client(base_url=url, timeout=30) as c:
        while True:
            assert c.post("/v1/chat/completions", json={**body, "temperature": 0}).status_code == 200
            assert c.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
            if stop_at.is_set():
                return


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--virtual-time-budget=6000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _near(px: np.ndarray, color: tuple[int, int, int], tol: int = 40) -> np.ndarray:
    return np.abs(px - np.array(color)).sum(axis=1) <= tol  # [n] bool: within tol of the colour


def test_dashboard_charts_render(server: Served, tmp_path: Path) -> None:
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text.split("<script>")[1] and "https://" not in page.text  # nothing external

    stop_at = threading.Event()
    once = threading.Event()
    once.set()
    _traffic(server.url, once)  # one round first: every chart has data from the first poll on
    traffic = threading.Thread(target=_traffic, args=(server.url, stop_at), daemon=True)
    traffic.start()
    try:
        url = server.url + "/dashboard?interval=1"
        dom = _chromium(tmp_path / "p1", "--dump-dom", url)
        shot = tmp_path / "dashboard.png"
        png = _chromium(tmp_path / "p2", f"--screenshot={shot}", url)
    finally:
        stop_at.set()
        traffic.join(30)

    assert dom.returncode == 0, dom.stderr[-2000:]
    assert png.returncode == 0 and shot.exists(), png.stderr[-2000:]
    polls = re.search(r'<body[^>]*data-polls="(\d+)"', dom.stdout)
    assert polls and int(polls.group(1)) >= 2, "the page did not poll /metrics at least twice"
    charts = {
        m.group(1): (int(m.group(2)), [int(v) for v in m.group(3).split(",")])
        for m in re.finditer(
            r'data-chart="(\w+)"[^>]*? data-points="(\d+)"[^>]*? data-rect="([\d,-]+)"', dom.stdout
        )
    }
    assert set(charts) >= WITH_DATA | {"cache", "route"}, dom.stdout[-3000:]

    img = Image.open(shot).convert("RGB")
    assert img.size == WINDOW
    for name, (points, (x, y, w, h)) in charts.items():
        assert w > 100 and h > 100, f"{name}: canvas laid out as {w}x{h}"
        px = np.asarray(img.crop((x, y, x + w, y + h)), dtype=np.int32).reshape(-1, 3)  # [w*h, rgb]
        distinct = len(np.unique(px, axis=0))
        assert distinct > 3, f"{name}: the canvas is blank"  # grid and labels at least
        if name in WITH_DATA:
            assert points >= 2, f"{name}: drew {points} points"
            coloured = int(sum(_near(px, c).sum() for c in PALETTE))
            assert coloured >= 40, f"{name}: only {coloured} pixels in series colours"
