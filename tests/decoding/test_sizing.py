"""limits.max_active when unset: 4 on a CPU; on a GPU from the models' footprints and free memory."""

from __future__ import annotations

import pytest
import torch

from decoding.errors import ModelLoadError
from decoding.loader import ModelSpec, load
from decoding.sizing import (
    CPU_MAX_ACTIVE,
    MAX_ACTIVE_GPU,
    Footprint,
    default_max_active,
    footprint,
    max_active_for,
)
from decoding.static import StaticModel

GiB = 1 << 30


def test_max_active_is_what_fits_after_weights_and_the_reserve():
    # an H200 with the 7B-shaped target and 0.5B draft at 8192 tokens: capped
    h200 = [Footprint(int(15.2 * GiB), 470 << 20), Footprint(1 * GiB, 100 << 20)]
    assert max_active_for(140 * GiB, 141 * GiB, h200) == MAX_ACTIVE_GPU
    # a 24 GB card with the 1.5B/0.5B pair: (23 - 4.1 - 2.4 - 1) GiB / (2 x 330 MiB) = 24.05
    pair = [Footprint(int(3.1 * GiB), 230 << 20), Footprint(1 * GiB, 100 << 20)]
    assert max_active_for(23 * GiB, 24 * GiB, pair) == 24
    # less free memory, fewer requests; never below one (loading then fails with torch's own error)
    assert max_active_for(12 * GiB, 24 * GiB, pair) < max_active_for(23 * GiB, 24 * GiB, pair)
    assert max_active_for(4 * GiB, 24 * GiB, pair) == 1


def test_footprint_counts_the_weights_and_the_static_cache_a_slot_holds():
    spec = ModelSpec("t", "tiny-random", dtype="float32", device="cpu", max_context=200)
    fp = footprint(spec, torch.device("cpu"))
    model = load(spec).model
    assert fp.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    static = StaticModel(model, max_len=200, slots=3, graphs=False)
    kv = sum(c.numel() * c.element_size() for c in static.k_cache + static.v_cache) // (static.slots + 1)
    assert fp.slot_bytes == kv


def test_a_source_that_cannot_be_read_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="could not load model 'x'"):
        footprint(ModelSpec("x", str(tmp_path)), torch.device("cpu"))


def test_on_a_cpu_the_default_is_fixed():
    assert default_max_active([ModelSpec("t", "tiny-random", device="cpu")]) == CPU_MAX_ACTIVE
