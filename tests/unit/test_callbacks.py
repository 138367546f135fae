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
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_autosp.callbacks import MemoryMonitor, SequenceThroughputMonitor

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
    """What ``SequenceThroughputMonitor.setup`` reads of a trainer that is about to fit."""
    strategy = SimpleNamespace(root_device=torch.device("cpu"), **strategy_attrs)
    return SimpleNamespace(
        world_size=world_size,
        strategy=strategy,
        precision_plugin=Precision(),
        enable_validation=False,
        state=SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING),
    )


def test_throughput_counts_each_sequence_once() -> None:
    batch = {"input_ids": torch.zeros(3, 64, dtype=torch.long), "mask": torch.ones(3, 64)}
    # 8 ranks in sp groups of 4: 2 dp groups of 3 sequences, each sharded to 64 of 128 global tokens.
    trainer = _fake_trainer(8, sp_size=4, sequence_shard=SimpleNamespace(global_len=128))
    monitor = SequenceThroughputMonitor(available_flops=1e12)
    monitor.setup(trainer, None, "fit")
    assert monitor.data_parallel_size(trainer) == 2  # Throughput's world: Lightning's would be 8
    assert (monitor.batch_size_fn(batch), monitor.length_fn(batch)) == (3, 3 * 128)
    monitor._start(trainer)  # sp_size may be "auto" until the strategy's setup: scaled at the first batch
    assert monitor.available_flops == 4 * 1e12  # an sp group's 4 devices: MFU is their mean
    # No sequence_shard (plain data parallelism): the batch's own sequence length, every rank its own.
    trainer = _fake_trainer(8)
    monitor = SequenceThroughputMonitor()
    monitor.setup(trainer, None, "fit")
    assert (monitor.data_parallel_size(trainer), monitor.length_fn(batch)) == (8, 3 * 64)
    # An explicit sp_size wins over the strategy's.
    assert SequenceThroughputMonitor(sp_size=8).data_parallel_size(_fake_trainer(8, sp_size=4)) == 1


def test_throughput_finds_the_sequence_tensor() -> None:
    monitor = SequenceThroughputMonitor()
    # Floating (B, S, H) features come after token ids; ids win regardless of order.
    batch = (torch.randn(2, 10, 4), torch.zeros(2, 9, dtype=torch.long), torch.zeros(2))
    assert (monitor.batch_size_fn(batch), monitor.length_fn(batch)) == (2, 2 * 9)
    assert monitor.length_fn([torch.randn(5, 7)]) == 35
    with pytest.raises(ValueError, match=r"no \(batch, seq\) tensor"):
        monitor.length_fn({"x": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"sp_size=3\) must divide the world size \(4 processes\)"):
        SequenceThroughputMonitor(sp_size=3).setup(_fake_trainer(4), None, "fit")
    with pytest.raises(ValueError, match="window_size=1 must be at least 2"):
        SequenceThroughputMonitor(window_size=1)


class TinyLMWithFlops(TinyLM):
    flops_per_batch = 4e6  # as measure_flops would report for one batch (here: a round number)


def test_throughput_monitor_logs_lightnings_rates_with_flops_and_mfu(tmp_path: Path) -> None:
    monitor = SequenceThroughputMonitor(window_size=2, available_flops=1e12)
    assert isinstance(monitor, ThroughputMonitor)
    trainer = _trainer(tmp_path, [monitor])
    trainer.fit(TinyLMWithFlops())
    rows = [r for r in _rows(trainer) if r.get("train/device/items_per_sec")]
    # The first batch (which compiles, in a compiled model) only starts the window (logged as step 0).
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for row in rows:
        samples_per_sec = float(row["train/device/samples_per_sec"])
        assert float(row["train/device/items_per_sec"]) == pytest.approx(samples_per_sec * 24)  # 24 tokens
        flops_per_sec = float(row["train/device/flops_per_sec"])
        assert flops_per_sec == pytest.approx(samples_per_sec / 4 * 4e6)  # batches of 4 samples
        assert float(row["train/device/mfu"]) == pytest.approx(flops_per_sec / 1e12)
    assert "train/items_per_sec" not in rows[0]  # one process: no whole-job figures beside the device's


def test_memory_monitor_peaks_reach_every_logger_without_lightnings_sync_dist_warning(tmp_path: Path) -> None:
    """The progress bar's ``peak_MiB_r0`` is in every logger's metrics at every measurement, and the
    epoch-end measurement draws no "use sync_dist=True" warning under a distributed strategy (here DDP over
    one gloo process, which warns as a multi-process run does)."""
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors.logger_connector import result

    result.warning_cache.clear()  # Lightning warns once per process; earlier tests may have warned
    monitor = MemoryMonitor(every_n_steps=2, plot=False, print_table=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=3,
        callbacks=[monitor],
        logger=[CSVLogger(tmp_path / "first"), CSVLogger(tmp_path / "second")],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyRegressor())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert [str(w.message) for w in caught if "sync_dist" in str(w.message)] == []
    # Step 2 and the epoch end at step 3, in both loggers, equal to the breakdown's peak.
    for logger in trainer.loggers:
        with (Path(logger.log_dir) / "metrics.csv").open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("peak_MiB_r0")]
        assert [int(row["step"]) for row in rows] == [2, 3]
        assert [float(row["peak_MiB_r0"]) for row in rows] == _column(rows, "memory/rank_0/peak_rss_mib")
    assert trainer.progress_bar_metrics["peak_MiB_r0"] == pytest.approx(monitor.latest[0]["peak_rss_mib"])
