"""torchmetrics updated inside compiled steps under AutoSPStrategy equal one device (Note [Metrics over
sequence shards]): per-step batch values and epoch values of accuracy (sum states), a mean per-token
loss, AUROC (concatenated states) and a mean of per-sequence losses, in training, validation and a test
run after fit, at an odd length, under the defaults (Inductor + SAC; ``tests/distributed/metrics_worker.py``,
2 ranks, sp=2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("metrics_worker.py")
# A hang guard, several times the launch on 2 busy cores (about a minute idle).
METRICS_HANG_GUARD_S = 900
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("metrics") / "metrics.json"
    code, stderr, _ = torchrun(2, WORKER, "--out", str(out), timeout=METRICS_HANG_GUARD_S)
    assert code == 0, stderr[-6000:]
    found = json.loads(out.read_text())
    assert "error" not in found["sp"], found["sp"]["error"]
    return found


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(b))


@pytest.mark.timeout(METRICS_HANG_GUARD_S + 60)
def test_batch_values_of_metrics_in_the_training_step(results):
    reference, sharded = results["reference"]["steps"], results["sp"]["steps"]
    assert len(reference) == len(sharded) == 2
    for ours, theirs in zip(sharded, reference):
        assert ours.keys() == theirs.keys()
        assert all(close(ours[k], theirs[k]) for k in ours), (ours, theirs)


@pytest.mark.timeout(METRICS_HANG_GUARD_S + 60)
def test_epoch_values_logged_and_computed(results):
    reference, sharded = results["reference"]["epoch"], results["sp"]
    logged = sharded["logged"]
    pairs = {
        "train_acc_epoch": "train_acc",
        "train_macro_acc_epoch": "train_macro_acc",
        "train_token_nll_epoch": "train_token_nll",
        "val_acc": "val_acc",
    }
    for ours, theirs in pairs.items():
        assert close(logged[ours], reference[theirs]), (ours, logged[ours], reference[theirs])
    for name in ("val_auroc", "val_sequence_nll"):  # concatenated states; sums over each sequence
        assert close(sharded["epoch"][name], reference[name]), (name, sharded["epoch"][name], reference[name])


@pytest.mark.timeout(METRICS_HANG_GUARD_S + 60)
def test_sync_dist_of_a_whole_sequence_value(results):
    # every rank of an sp group holds the whole-sequence loss: a mean over dp x sp ranks leaves it as it is
    assert close(results["sp"]["logged"]["val_loss"], results["reference"]["val_loss"])


@pytest.mark.timeout(METRICS_HANG_GUARD_S + 60)
def test_metrics_in_the_test_step_after_fit(results):
    # trainer.test after fit: the metrics the first stage gave back work as one device's
    assert close(results["sp"]["tested"]["test_acc"], results["reference"]["epoch"]["test_acc"])
