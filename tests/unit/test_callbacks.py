"""MemoryMonitor and SequenceThroughputMonitor in one CPU process."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_autosp.callbacks import MemoryMonitor, SequenceThroughputMonitor, global_tokens

MIB = 2**20


class TinyRegressor(L.LightningModule):
    def __init__(self, compile_backend: Any = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        self.forward_fn = torch.compile(self.net, backend=compile_backend) if compile_backend else self.net

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.forward_fn(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Momentum SGD keeps exactly one buffer per parameter: optimizer state == parameter bytes.
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)), 8)


class TokenDataset(Dataset):
    def __init__(self, n: int, seq_len: int) -> None:
        self.ids = torch.randint(0, 50, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


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
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(32, 24), batch_size=4)


def _trainer(tmp_path: Path, callbacks: list[L.Callback], max_steps: int = 4) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _rows(trainer: L.Trainer) -> list[dict[str, str]]:
    with (Path(trainer.logger.log_dir) / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def test_memory_monitor_logs_breakdown_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = TinyRegressor()
    monitor = MemoryMonitor(every_n_steps=2)
    trainer = _trainer(tmp_path, [monitor])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MemoryMonitor")
        trainer.fit(model)

    rows = _rows(trainer)
    param_mib = sum(p.numel() for p in model.parameters()) * 4 / MIB
    # Steps 2 and 4; the epoch end at step 4 is not logged twice.
    assert [int(r["step"]) for r in rows if r.get("memory/rank_0/params_mib")] == [2, 4]
    for key in ("memory/rank_0/peak_rss_mib", "memory/rank_0/rss_mib", "memory/max/peak_rss_mib"):
        assert all(0 < v < 24 * 1024 for v in _column(rows, key)), key
    assert _column(rows, "memory/rank_0/params_mib") == [pytest.approx(param_mib, rel=1e-12)] * 2
    assert _column(rows, "memory/rank_0/grads_mib") == [pytest.approx(param_mib, rel=1e-12)] * 2
    assert _column(rows, "memory/rank_0/optimizer_mib") == [pytest.approx(param_mib, rel=1e-12)] * 2
    assert _column(rows, "memory/min/params_mib") == _column(rows, "memory/max/params_mib")
    saved = _column(rows, "memory/rank_0/saved_for_backward_mib")
    # Input, ReLU output (also the second Linear's input), MSE's prediction and target; weights excluded.
    assert saved == [pytest.approx((8 * 32 + 8 * 64 + 2 * 8 * 8) * 4 / MIB)] * 2
    assert "memory/rank_0/allocated_mib" not in rows[0]  # no CUDA counters on CPU

    stats = monitor.latest[0]
    assert set(monitor.latest) == {0}
    assert stats["peak_rss_mib"] >= stats["rss_mib"] > 0
    assert [step for step, _ in monitor.history] == [2, 4]

    assert monitor.plot_path == Path(trainer.log_dir) / "memory_per_rank.png"
    assert monitor.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Saved for backward" in out and "Memory per rank" in out


def test_memory_monitor_counts_saved_tensors_of_compiled_step(tmp_path: Path) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")
    monitor = MemoryMonitor(every_n_steps=1, plot=False, print_table=False)
    trainer = _trainer(tmp_path, [monitor], max_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MemoryMonitor")
        trainer.fit(TinyRegressor(compile_backend=backend))
    # One graph, compiled once: the hooks neither break the graph nor force recompiles.
    assert backend.frame_count == 1
    saved = _column(_rows(trainer), "memory/rank_0/saved_for_backward_mib")
    # Same as eager: input, ReLU output, MSE's prediction and target (8x32 + 8x64 + 2 x 8x8 floats).
    assert saved == [pytest.approx((8 * 32 + 8 * 64 + 2 * 8 * 8) * 4 / MIB)] * 2
    assert monitor.plot_path is None


def test_memory_monitor_reports_saved_for_backward_missing_when_hooks_are_disabled(tmp_path: Path) -> None:
    monitor = MemoryMonitor(every_n_steps=2, plot=False, print_table=False)
    trainer = _trainer(tmp_path, [monitor])
    with (
        torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this test"),
        pytest.warns(UserWarning, match="saved_for_backward_mib` will be missing") as record,
    ):
        trainer.fit(TinyRegressor())
    assert sum("MemoryMonitor" in str(w.message) for w in record) == 1
    rows = _rows(trainer)
    assert "memory/rank_0/saved_for_backward_mib" not in rows[0]
    assert _column(rows, "memory/rank_0/params_mib")
    assert "saved_for_backward_mib" not in monitor.latest[0]


def test_memory_monitor_reads_cuda_counters_on_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {
        "max_memory_allocated": 4 * MIB,
        "memory_allocated": 3 * MIB,
        "max_memory_reserved": 8 * MIB,
        "memory_reserved": 6 * MIB,
    }
    for name, value in counters.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    module = SimpleNamespace(device=torch.device("cuda", 0), parameters=lambda: iter(()))
    stats = MemoryMonitor().measure(SimpleNamespace(optimizers=[]), module)
    assert {
        k: stats[k] for k in ("peak_allocated_mib", "allocated_mib", "peak_reserved_mib", "reserved_mib")
    } == {
        "peak_allocated_mib": 4.0,
        "allocated_mib": 3.0,
        "peak_reserved_mib": 8.0,
        "reserved_mib": 6.0,
    }
    assert stats["rss_mib"] > 0 and stats["params_mib"] == 0


def test_memory_monitor_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        MemoryMonitor(every_n_steps=0)


def _fake_trainer(world_size: int, **strategy_attrs: object) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(**strategy_attrs))


def test_throughput_counts_each_sequence_once() -> None:
    batch = {"input_ids": torch.zeros(3, 64, dtype=torch.long), "mask": torch.ones(3, 64)}
    monitor = SequenceThroughputMonitor()
    # 8 ranks in sp groups of 4: 2 dp groups of 3 sequences, each sharded to 64 of 128 global tokens.
    trainer = _fake_trainer(8, sp_size=4, sequence_shard=SimpleNamespace(global_len=128))
    assert monitor.tokens_per_step(trainer, batch) == 3 * 2 * 128
    # No sequence_shard: the batch's own sequence length.
    assert monitor.tokens_per_step(_fake_trainer(8, sp_size=4), batch) == 3 * 2 * 64
    # Plain data parallelism: every rank adds its own samples.
    assert monitor.tokens_per_step(_fake_trainer(8), batch) == 3 * 8 * 64
    # An explicit sp_size wins over the strategy's.
    assert SequenceThroughputMonitor(sp_size=8).tokens_per_step(_fake_trainer(8, sp_size=4), batch) == 3 * 64


def test_throughput_finds_the_sequence_tensor() -> None:
    # Floating (B, S, H) features come after token ids; ids win regardless of order.
    batch = (torch.randn(2, 10, 4), torch.zeros(2, 10, dtype=torch.long), torch.zeros(2))
    assert global_tokens(batch, world_size=2, sp_size=2) == 2 * 10
    assert global_tokens([torch.randn(5, 7)], world_size=1, sp_size=1) == 35
    with pytest.raises(ValueError, match=r"no \(batch, seq\) tensor"):
        global_tokens({"x": torch.zeros(4)}, world_size=1, sp_size=1)
    with pytest.raises(ValueError, match="divisor"):
        global_tokens(batch, world_size=4, sp_size=3)
    with pytest.raises(ValueError, match="divisor"):
        SequenceThroughputMonitor(sp_size=3).setup(_fake_trainer(4), None, "fit")


def test_throughput_monitor_logs_tokens_per_sec(tmp_path: Path) -> None:
    monitor = SequenceThroughputMonitor(log_every_n_steps=1)
    trainer = _trainer(tmp_path, [monitor])
    trainer.fit(TinyLM())
    rows = _rows(trainer)
    # The first batch only starts the clock.
    assert [int(r["step"]) for r in rows if r.get("throughput/tokens_per_sec")] == [2, 3, 4]
    tps = _column(rows, "throughput/tokens_per_sec")
    assert all(v > 0 for v in tps)
    assert _column(rows, "throughput/tokens_per_sec_per_rank") == tps  # one rank
    assert trainer.callback_metrics["throughput/tokens_per_sec"] > 0
