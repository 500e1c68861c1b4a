"""Benchmarks write their results into docs/benchmarks.md, each into its own marked section, so one
benchmark's rerun replaces its numbers without touching the others'."""

from __future__ import annotations

import gc
import itertools
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from decoding.params import RequestStats

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every number here was written by a script under `bench/`, with the machine, the command and the
date it ran. Rerun one with the command its section names; it replaces only its own section.
Speed is never asserted by tests.
"""


def cpu_model() -> str:
    """The CPU's model as /proc/cpuinfo names it ('' where it does not)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine() -> str:
    cpu = cpu_model() or "unknown CPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def k_steps(stats: Iterable[RequestStats]) -> dict[int, int]:
    """Steps by the k a row drafted in them (0: plain), summed over the rows: where a mode's
    tokens a step come from (``drafted_by_position[i]`` counts steps that drafted an (i+1)-th)."""
    out: dict[int, int] = {}
    for st in stats:
        out[0] = out.get(0, 0) + st.steps - st.spec_steps
        d = [*st.drafted_by_position, 0]
        for k, (n, deeper) in enumerate(itertools.pairwise(d), start=1):
            if n > deeper:  # steps that drafted a k-th token and no (k+1)-th
                out[k] = out.get(k, 0) + n - deeper
    return dict(sorted(out.items()))


class GcPauses:
    """The garbage collector's pauses, (generation, seconds) each, as ``gc.callbacks`` report them."""

    def __init__(self) -> None:
        self.started = 0.0
        self.pauses: list[tuple[int, float]] = []
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self.started))


def command() -> str:
    return " ".join(["python -m", _module(), *sys.argv[1:]])


def _module() -> str:
    p = Path(sys.argv[0]).resolve()
    try:
        rel = p.relative_to(DOC.parent.parent)
    except ValueError:
        return p.stem
    return ".".join(rel.with_suffix("").parts)


def cpu_kind() -> str:
    """The CPU kind a CPU run is filed under: the bf16 matrix instructions decide llama.cpp's and
    torch's multi-row costs, so each kind keeps its own section and results (amx, avx512-bf16, avx2)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((ln.split() for ln in lines if ln.startswith("flags")), [])
    return "amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags else "avx2"


def stamp() -> str:
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=DOC.parent.parent
    )
    return (
        f"Machine: {machine()}. Command: `{command()}`. "
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Commit: {rev.stdout.strip() or 'unknown'}."
    )


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
    """Replace (or append) the section between ``<!-- bench:name -->`` markers."""
    text = doc.read_text() if doc.exists() else HEADER
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
