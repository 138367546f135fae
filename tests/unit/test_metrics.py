"""``MetricsOverShards`` gives metrics back as they were (Note [Metrics over sequence shards])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.metrics import MetricsOverShards

torchmetrics = pytest.importorskip("torchmetrics")


def installed_and_uninstalled(module: nn.Module, times: int = 1) -> None:
    """What one strategy stage per ``times`` does to the module's metrics (no sequence parallelism here)."""
    metrics = MetricsOverShards(SequenceTags(), lambda: None, lambda: None, lambda: None)
    for _ in range(times):
        metrics.install(module)
        metrics.uninstall()


def test_uninstall_restores_torchmetrics_own_update_wrapper() -> None:
    module = nn.Module()
    module.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
    own = {name: module.acc.__dict__[name] for name in ("update", "compute")}
    installed_and_uninstalled(module, times=2)  # fit, then validate: each stage installs and uninstalls
    assert {name: module.acc.__dict__[name] for name in ("update", "compute")} == own
    assert "forward" not in module.acc.__dict__
    # torchmetrics' update wrapper resets compute's cache and counts updates: without it, the second
    # compute returned the first one's 1.0, and compute warned that update was never called.
    module.acc.update(torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert module.acc.compute() == 1.0
    module.acc.update(torch.tensor([0, 1]), torch.tensor([1, 0]))
    assert module.acc.compute() == 0.5
    assert module.acc.update_count == 2
