"""README's "Every setting" table and the settings models agree both ways: every setting is there
with its default, and every row is a setting. An operator reads the README, not gateway/settings.py."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from gateway.settings import Settings
from tests.deploy.chart import ROOT

ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \| (.+) \|$")


class Setting(NamedTuple):
    path: str  # as the README writes it: `limits.max_n`, `models[].name`, `router.models.<name>.draft`
    owner: type[BaseModel]
    name: str
    inner: tuple[type[BaseModel], str] | None  # the settings model it holds, and how a path enters it

    def value(self, raw: Any = ...) -> Any:
        """The default, or ``raw`` read as the setting's type, in JSON terms."""
        field = self.owner.model_fields[self.name]
        adapter = TypeAdapter(field.annotation)
        value = field.get_default(call_default_factory=True) if raw is ... else adapter.validate_python(raw)
        return adapter.dump_python(value, mode="json")


def _nested(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """ "." a settings model, "[]." a list of them, ".<name>." a mapping of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "."
    for arg in typing.get_args(annotation):
        inner = _nested(arg)
        if inner is not None:
            origin = typing.get_origin(annotation)
            return inner[0], "[]." if origin is list else ".<name>." if origin is dict else inner[1]
    return None


def _walk(model: type[BaseModel], prefix: str = "") -> Iterator[Setting]:
    for name, field in model.model_fields.items():
        s = Setting(prefix + name, model, name, _nested(field.annotation))
        yield s
        if s.inner is not None:
            yield from _walk(s.inner[0], s.path + s.inner[1])


def settings() -> dict[str, Setting]:
    """Every documented path: leaves, and lists and mappings of entries. Entries of a kind found at
    several paths are listed under the shortest alone (`router.upstreams` holds `upstreams`'s)."""
    home: dict[type[BaseModel], str] = {}
    for s in _walk(Settings):
        if s.inner is not None and s.inner[1] != ".":
            kind = s.inner[0]
            if kind not in home or s.path.count(".") < home[kind].count("."):
                home[kind] = s.path
    out: dict[str, Setting] = {}
    elsewhere: list[str] = []
    for s in _walk(Settings):
        if any(s.path.startswith(e) for e in elsewhere):
            continue
        if s.inner is None or s.inner[1] != ".":
            out[s.path] = s
        if s.inner is not None and s.inner[1] != "." and home[s.inner[0]] != s.path:
            elsewhere.append(s.path + s.inner[1])
    return out


def readme_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Every setting", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"README lists {m.group(1)} twice"
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_setting_is_in_the_readme_and_every_row_is_a_setting() -> None:
    rows, fields = readme_rows(), settings()
    assert len(fields) > 80
    assert not sorted(set(fields) - set(rows)), (
        f"settings the README lacks: {sorted(set(fields) - set(rows))}"
    )
    assert not sorted(set(rows) - set(fields)), (
        f"README rows that are no setting: {sorted(set(rows) - set(fields))}"
    )


@pytest.mark.parametrize("path", list(settings()))
def test_the_readme_gives_the_default(path: str) -> None:
    s, cell = settings()[path], readme_rows().get(path)
    assert cell is not None, path
    if s.owner.model_fields[s.name].is_required():
        assert cell == "required", (path, cell)
        return
    default = s.value()
    if cell.startswith("`"):
        documented = s.value(yaml.safe_load(cell.strip("`")))
        assert documented == default, f"{path}: README says {documented!r}, the default is {default!r}"
    else:  # words for a default that is a list of entries (the default pair, the two tiers)
        assert isinstance(default, list) and default and all(isinstance(v, dict) for v in default), (
            path,
            cell,
        )


def _yaml_blocks(path: str) -> list[str]:
    return re.findall(r"^ *```yaml\n(.*?)^ *```", (ROOT / path).read_text(), re.S | re.M)


def test_the_readme_example_config_builds_an_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The Configuration section's YAML, as an operator copies it, passes the settings validator and
    the checks an app makes at start (tiers naming models and upstreams, the upstream's key)."""
    from gateway.app import create_app
    from gateway.settings import load_settings

    (block,) = _yaml_blocks("README.md")
    cfg = tmp_path / "specgate.yaml"
    cfg.write_text(block)
    monkeypatch.setenv("VLLM_KEY", "unused")
    create_app(load_settings(cfg, env={}))


def test_the_scaling_guides_chart_config_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gateway.app import create_app
    from gateway.settings import load_settings

    block = next(b for b in _yaml_blocks("docs/scaling.md") if "upstreams:" in b)
    cfg = tmp_path / "specgate.yaml"
    cfg.write_text(block)
    monkeypatch.setenv("VLLM_API_KEY", "unused")
    s = load_settings(cfg, env={})
    assert [t.name for t in s.router.tiers] == ["small", "large", "remote"]
    create_app(s)
