"""Shared fixtures: tiny random models (built once, deterministic) and the real pair (slow tests)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.servers import RedisProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="module")
def _torch_threads() -> Iterator[None]:
    """Loading models that all run on llama.cpp leaves torch one thread (decoding.loader): give the
    next module back what it had, so one module's models do not slow the rest of the suite."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_models():
    """Float32 tiny target, tiny draft, and the target drafting for itself (acceptance 1), on the CPU
    default backend (static: requests batch), with KV slots for batches of 16."""
    from decoding.loader import ModelSpec, load_all

    return load_all(
        [
            ModelSpec("tiny", "tiny-random", draft="tiny-draft", dtype="float32", device="cpu", slots=16),
            ModelSpec("tiny-draft", "tiny-random-draft", dtype="float32", device="cpu", slots=16),
            ModelSpec("tiny-self", "tiny-random", draft="tiny", dtype="float32", device="cpu", slots=16),
        ]
    )


@pytest.fixture(scope="session")
def real_pair():
    """The real Qwen2.5-Coder pair in float32 (slow tests only; pulled by `make test`)."""
    from decoding import store
    from decoding.loader import ModelSpec, load_all

    for alias in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        if not store.is_cached(alias):
            pytest.skip(f"{alias} not pulled (run `specgate models pull`)")
    return load_all(
        [
            ModelSpec("target", "qwen2.5-coder-1.5b", draft="draft", dtype="float32", device="cpu"),
            ModelSpec("draft", "qwen2.5-coder-0.5b", dtype="float32", device="cpu"),
        ],
        pull=False,
    )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One redis-server of our own for the whole run (cache and rate-limit tests use key prefixes)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
