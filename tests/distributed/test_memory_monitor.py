"""MemoryMonitor (and SequenceThroughputMonitor) over two CPU processes with gloo."""

from __future__ import annotations

import atexit
import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_autosp.callbacks import MemoryMonitor, SequenceThroughputMonitor

pytestmark = pytest.mark.distributed


class TokenDataset(Dataset):
    def __init__(self, n: int, seq_len: int) -> None:
        self.ids = torch.randint(0, 50, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


# At module top level: spawned workers unpickle it by import.
class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.head(self.emb(ids[:, :-1]))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(64, 24), batch_size=4)


class DestroyProcessGroupAtExit(L.Callback):
    """Each spawned rank exits right after fit; an undestroyed gloo group can abort it there
    (pytorch/pytorch#190489), which AutoSPStrategy prevents and plain DDPStrategy does not."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        atexit.register(_destroy_dist_connection)


def test_memory_monitor_two_cpu_ranks(tmp_path: Path) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", start_method="spawn"),
        max_steps=4,
        callbacks=[
            MemoryMonitor(every_n_steps=2),
            SequenceThroughputMonitor(window_size=2),
            DestroyProcessGroupAtExit(),
        ],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM())

    (log_dir,) = (tmp_path / "lightning_logs").iterdir()
    with (log_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    memory_rows = [r for r in rows if r.get("memory/rank_0/rss_mib")]
    assert [int(r["step"]) for r in memory_rows] == [2, 4]

    params_mib = sum(p.numel() for p in TinyLM().parameters()) * 4 / 2**20
    for row in memory_rows:
        for rank in (0, 1):
            for stat in ("rss_mib", "peak_rss_mib"):
                assert 0 < float(row[f"memory/rank_{rank}/{stat}"]) < 24 * 1024
            # Replicated model: every rank holds all parameters, their grads and Adam's two moments.
            assert float(row[f"memory/rank_{rank}/params_mib"]) == pytest.approx(params_mib)
            assert float(row[f"memory/rank_{rank}/grads_mib"]) == pytest.approx(params_mib)
            assert float(row[f"memory/rank_{rank}/optimizer_mib"]) >= 2 * params_mib
            assert float(row[f"memory/rank_{rank}/saved_for_backward_mib"]) > 0
        assert "memory/rank_2/rss_mib" not in row
        for rank in (0, 1):  # the progress bar's per-rank peaks reach the loggers too
            assert float(row[f"peak_MiB_r{rank}"]) == float(row[f"memory/rank_{rank}/peak_rss_mib"])
        per_rank = [float(row[f"memory/rank_{rank}/rss_mib"]) for rank in (0, 1)]
        assert float(row["memory/max/rss_mib"]) == max(per_rank)
        assert float(row["memory/min/rss_mib"]) == min(per_rank)

    # DDP: each rank draws its own samples (sp_size 1), so the job's rate is twice one rank's.
    rates = [r for r in rows if r.get("train/items_per_sec")]
    assert len(rates) == 3
    for row in rates:
        device_tokens = float(row["train/device/items_per_sec"])
        assert device_tokens > 0
        assert device_tokens == pytest.approx(float(row["train/device/samples_per_sec"]) * 24)
        assert float(row["train/items_per_sec"]) == pytest.approx(2 * device_tokens)

    assert (log_dir / "memory_per_rank.png").read_bytes()[:4] == b"\x89PNG"
