"""The gateway never imports torch: importing the app, the server or the CLI loads no model stack
(the engine is built, and decoding's engine imported, only where the server starts it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_gateway_loads_no_torch() -> None:
    code = (
        "import sys\n"
        "import gateway.app, gateway.server, gateway.cli\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    # a fresh interpreter: this one has torch loaded by other tests
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
