"""data_parallel="fsdp" starts a model no rank holds whole: built on the meta device, sharded there, then
each rank materialises its shard. 4 ranks (gloo, CPU), a 290 MiB model (``meta_init_worker.py``).

Training from a meta-initialised model equals one device: the ``fsdp_meta_*`` cases of
``test_parity.py`` (dp=2 x sp=2, both gather modes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from tests.launch import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("meta_init_worker.py")
RANKS = 4
# What setup holds besides the shard: the largest module whole while it is initialised (4 MiB here),
# Python and DTensor objects for 24 layers, the optimizer; measured 10-18 MiB.
CONSTANT_MIB = 32


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("meta_init")
    # Large blocks are unmapped when freed, so one phase's freed memory is not reused unseen by the next.
    with mock.patch.dict(os.environ, {"MALLOC_MMAP_THRESHOLD_": "65536"}):
        code, stderr, _ = torchrun(RANKS, WORKER, "--out", str(out), timeout=400)
    assert code == 0, stderr[-6000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("phase", ["meta_per_use", "meta_per_step"])
def test_setup_of_a_meta_model_holds_a_quarter_of_it_per_rank(results, phase) -> None:
    for rank, per_phase in results.items():
        meta, whole = per_phase[phase], per_phase["whole_per_use"]
        assert "error" not in meta, f"rank {rank}: {meta.get('error')}"
        assert "error" not in whole, f"rank {rank}: {whole.get('error')}"
        assert meta["sharded"] and meta["finite"]
        assert meta["local_mib"] <= meta["full_mib"] / RANKS + 1
        assert meta["setup_peak_mib"] <= meta["full_mib"] / RANKS + CONSTANT_MIB, (rank, meta)
        # the same measurement sees the whole model when it is built whole
        assert whole["setup_peak_mib"] >= 0.9 * whole["full_mib"], (rank, whole)


@pytest.mark.timeout(450)
def test_auto_sp_size_plans_for_the_model_configure_model_builds(results) -> None:
    # The module has no parameters until configure_model; the plan counts all of them (shard per rank).
    for per_phase in results.values():
        meta = per_phase["meta_per_use"]
        assert meta["planned_params_bytes"] == meta["full_bytes_per_rank"] > 0
