"""The semantic cache's embedder on shutdown: a load that a closing process cuts short is no error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from decoding.embedder import SentenceEmbedder


def test_a_load_failing_after_close_logs_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server stopping while the embedder still loads (a model that failed to load, a SIGTERM in
    the first seconds) logged "semantic cache off: embedder ... failed to load" with a traceback of
    the interpreter's shutdown, after the process had already said why it stopped."""
    closing = SentenceEmbedder(str(tmp_path / "no-model"))
    closing.close()
    with caplog.at_level(logging.DEBUG, logger="specgate"):
        closing._load()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    open_one = SentenceEmbedder(str(tmp_path / "no-model"))
    with caplog.at_level(logging.DEBUG, logger="specgate"):
        open_one._load()  # while serving, a failed load is the operator's to see
    assert [r for r in caplog.records if r.levelno >= logging.ERROR]
    open_one.close()
