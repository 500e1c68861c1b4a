"""The model store as an operator breaks it: a damaged GGUF or converted file, a truncated part,
an unwritable store. Each test works on a throwaway SPECGATE_HOME holding a small pinned stand-in."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from decoding import store
from gateway import cli

ALIAS = "fake-pinned"
PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30]
GGUF = b"".join(PARTS)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    pin = store.PinnedModel(
        ALIAS,
        "a stand-in",
        ("fake-pinned-part1==0.1.0", "fake-pinned-part2==0.1.0"),
        len(GGUF),
        hashlib.sha256(GGUF).hexdigest(),
    )
    monkeypatch.setitem(store.PINNED, ALIAS, pin)
    wheels = tmp_path / "wheels" / ALIAS
    wheels.mkdir(parents=True)
    for i, part in enumerate(PARTS, 1):
        with zipfile.ZipFile(wheels / f"fake_pinned_part{i}-0.1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_pinned_part{i}-0.1.0.data/data/part{i:02d}.bin", part)

    def convert(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> None:  # torch-free stand-in
        tmp = out_dir.with_name(out_dir.name + ".partial")
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(gguf.read_bytes()[::-1])
        store.write_manifest(tmp)
        tmp.rename(out_dir)

    def offline(pin: store.PinnedModel, dest: Path) -> list[Path]:  # the stand-in is on no registry
        raise store.StoreError(f"could not download {pin.alias}: offline")

    monkeypatch.setattr(store, "convert_gguf", convert)
    monkeypatch.setattr(store, "_download", offline)
    return tmp_path


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_gguf_is_never_handed_to_the_backend(home: Path) -> None:
    gguf = store.gguf_file(ALIAS)
    assert gguf.read_bytes() == GGUF
    _flip(gguf)
    # joined again from the kept (verified) parts, not returned as it lies
    assert store.gguf_file(ALIAS).read_bytes() == GGUF
    gguf.write_bytes(GGUF[:-10])  # truncated
    assert store.gguf_file(ALIAS).read_bytes() == GGUF
    store.pull(ALIAS, keep_gguf=True)
    _flip(gguf, at=5000)
    assert "sha256" in store.check(ALIAS)[0]
    store.pull(ALIAS)  # what `specgate models verify` says to run repairs it
    assert gguf.read_bytes() == GGUF and store.check(ALIAS) == []


def test_a_truncated_part_is_a_store_error_naming_it(home: Path) -> None:
    wheel = next((home / "wheels" / ALIAS).glob("fake_pinned_part2-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:50])
    with pytest.raises(store.StoreError, match="fake_pinned_part2"):
        store.gguf_file(ALIAS)
    assert not (home / "gguf" / f"{ALIAS}.gguf").exists()
    assert not list((home / "gguf").glob("*.partial"))


def test_a_damaged_converted_model_is_refused_or_rebuilt(home: Path) -> None:
    d = store.pull(ALIAS)
    manifest = json.loads((d / store.MANIFEST).read_text())
    assert set(manifest) == {"config.json", "model.safetensors"}
    assert store.check(ALIAS) == []
    _flip(d / "model.safetensors")
    problems = store.check(ALIAS)
    assert len(problems) == 1 and "model.safetensors" in problems[0]
    with pytest.raises(store.StoreError, match=r"model\.safetensors.*specgate models pull fake-pinned"):
        store.verified_dir(ALIAS, pull=False)
    # a pull repairs it (the verified GGUF converted again)
    store.pull(ALIAS)
    assert store.check(ALIAS) == []
    (d / "model.safetensors").write_bytes(b"")  # a wrong size is seen without hashing
    assert "model.safetensors" in store.check(ALIAS, full=False)[0]


def test_models_verify_names_the_damaged_file(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store.pull(ALIAS)
    assert cli.main(["models", "verify", ALIAS]) == 0
    _flip(store.model_dir(ALIAS) / "model.safetensors")
    assert cli.main(["models", "verify", ALIAS]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and f"specgate models pull {ALIAS}" in err
    assert cli.main(["models", "verify", "no-such-model"]) == 1
    assert "unknown model alias" in capsys.readouterr().err


def test_an_unwritable_store_is_a_clear_error(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (home / "gguf").write_text("not a directory")  # what a read-only or full disk gives: an OSError
    assert cli.main(["models", "pull", ALIAS]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "SPECGATE_HOME" in err and "Traceback" not in err


def test_the_loader_refuses_a_damaged_model_naming_the_file(home: Path) -> None:
    from decoding import loader
    from decoding.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not in the store"):
        loader.resolve(ALIAS, pull=False)
    d = store.pull(ALIAS)
    assert loader.resolve(ALIAS, pull=False) == (d, None)
    (d / "config.json").write_text('{"garbage": 1}')
    with pytest.raises(ModelLoadError, match=r"config\.json.*specgate models pull"):
        loader.resolve(ALIAS, pull=False)
    assert loader.resolve(ALIAS) == (d, None)  # may pull: rebuilt
    assert (d / "config.json").read_text() == "{}"


def test_a_directory_converted_before_checksums_gets_them_on_first_use(home: Path) -> None:
    d = store.pull(ALIAS)
    (d / store.MANIFEST).unlink()
    assert "missing" in store.check(ALIAS)[0]
    assert store.verified_dir(ALIAS, pull=False) == d
    assert store.check(ALIAS) == []


def test_a_second_pull_waits_for_the_first_and_finds_its_work_done(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    calls: list[Path] = []
    second = threading.Thread(target=store.pull, args=(ALIAS,))
    convert = store.convert_gguf

    def first_converts_while_another_pulls(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
        calls.append(out_dir)
        if len(calls) == 1:
            second.start()
            second.join(2)  # unlocked, the second pull would be converting into the same place by now
        convert(gguf, out_dir, dtype)

    monkeypatch.setattr(store, "convert_gguf", first_converts_while_another_pulls)
    store.pull(ALIAS)
    second.join()
    assert len(calls) == 1 and store.check(ALIAS) == []
