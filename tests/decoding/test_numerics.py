"""``dtype: auto`` on the torch CPU path is measured once at start and logged with its reason."""

from __future__ import annotations

import logging

import pytest
import torch

from decoding import loader


@pytest.fixture
def timings(monkeypatch):
    """Scripted matmul seconds by (dtype, rows); the choice is re-measured for each test."""
    table: dict[tuple[torch.dtype, int], float] = {}
    monkeypatch.setattr(loader, "_linear_seconds", lambda dtype, rows: table[(dtype, rows)])
    loader.cpu_auto_dtype.cache_clear()
    yield table
    loader.cpu_auto_dtype.cache_clear()


def test_bf16_where_its_multi_row_matmul_is_cheap(timings, caplog):
    timings.update({(torch.bfloat16, 1): 1e-3, (torch.bfloat16, 8): 1.1e-3, (torch.float32, 8): 4e-3})
    with caplog.at_level(logging.INFO, logger="specgate.loader"):
        assert loader.pick_dtype("auto", torch.device("cpu")) == torch.bfloat16
        assert loader.pick_dtype("auto", torch.device("cpu")) == torch.bfloat16  # measured once
    lines = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert len(lines) == 1 and "bfloat16" in lines[0] and "1.1x" in lines[0]


def test_float32_where_bf16_runs_rows_one_by_one(timings, caplog):
    timings.update({(torch.bfloat16, 1): 1e-3, (torch.bfloat16, 8): 8e-3, (torch.float32, 8): 4e-3})
    with caplog.at_level(logging.INFO, logger="specgate.loader"):
        assert loader.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert any("float32, bf16 runs rows one by one" in r.getMessage() for r in caplog.records)


def test_explicit_dtypes_and_cuda_are_not_measured(timings):
    assert loader.pick_dtype("float32", torch.device("cpu")) == torch.float32
    assert loader.pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert loader.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert not timings  # nothing was looked up


def test_the_real_measurement_runs_here():
    loader.cpu_auto_dtype.cache_clear()
    try:
        assert loader.cpu_auto_dtype() in (torch.bfloat16, torch.float32)
    finally:
        loader.cpu_auto_dtype.cache_clear()
