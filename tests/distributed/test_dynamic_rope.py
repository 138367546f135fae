"""transformers' dynamic-NTK rope trains exactly over steps whose length grows past
``max_position_embeddings`` and falls back below it, though Dynamo runs some of each step's frames
eagerly (Note [Eager code between graphs]; ``tests/distributed/rope_steps_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launch import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("rope_steps_worker.py")
# A hang guard, several times the launch on 2 busy cores (under a minute idle).
ROPE_HANG_GUARD_S = 900


@pytest.mark.timeout(ROPE_HANG_GUARD_S + 60)
def test_every_step_equals_one_device(tmp_path):
    out = tmp_path / "rope.json"
    code, stderr, _ = torchrun(2, WORKER, "--out", str(out), timeout=ROPE_HANG_GUARD_S)
    assert code == 0, stderr[-6000:]
    found = json.loads(out.read_text())
    assert "error" not in found["sp"], found["sp"]["error"]
    assert len(found["sp"]) == len(found["reference"]) == 5
    for step, (sharded, reference) in enumerate(zip(found["sp"], found["reference"])):
        assert abs(sharded["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"]), step
        grads, expected = torch.tensor(sharded["grads"]), torch.tensor(reference["grads"])
        assert (grads - expected).abs().max() <= 1e-4 * expected.abs().max(), step
