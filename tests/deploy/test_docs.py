"""What README.md and docs/*.md tell an operator to run exists: modules behind `python -m`, files
they name, `specgate` subcommands; and every benchmark section says where, when and how it ran."""

from __future__ import annotations

import importlib.util
import re

import pytest

from gateway.cli import build_parser
from tests.deploy.chart import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.name: p.read_text() for p in DOCS}


def _all(pattern: str) -> set[str]:
    return {m for text in TEXT.values() for m in re.findall(pattern, text)}


@pytest.mark.parametrize(
    "module", sorted(_all(r"python -m ([a-z_][a-z0-9_.]*[a-z0-9_])") | _all(r"`(bench\.[a-z_]+)"))
)
def test_modules_the_docs_run_exist(module: str) -> None:
    assert importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize(
    "path",
    sorted(_all(r"\b((?:tests|bench|deploy|gateway|decoding|router|scripts)/[A-Za-z0-9_./-]+\.[a-z]+)\b")),
)
def test_files_the_docs_name_exist(path: str) -> None:
    assert (ROOT / path).exists(), path


@pytest.mark.parametrize("command", sorted(_all(r"`specgate ((?:[a-z]+)(?: [a-z]+)?)")))
def test_specgate_commands_the_docs_show_exist(command: str) -> None:
    words = [w for w in command.split() if not w.startswith("-")]
    parser = build_parser()
    with pytest.raises(SystemExit) as done:
        parser.parse_args([*words[:2], "--help"])
    assert done.value.code == 0, command


def test_every_benchmark_section_says_where_when_and_how() -> None:
    sections = re.split(r"\n(?=## )", TEXT["benchmarks.md"])[1:]
    assert len(sections) > 10
    for s in sections:
        head = s[:3000]
        title = s.splitlines()[0]
        assert re.search(r"20\d\d-\d\d-\d\d", head), f"{title}: no date"
        assert re.search(r"Command|`python -m|`make bench", head), f"{title}: no command"
        assert re.search(r"Machine|Device|H200|EPYC|Xeon|\bcores?\b", head), f"{title}: no machine"
