"""Callbacks that report per-rank memory and sequence-aware token throughput.

``MemoryMonitor`` logs, in MiB, for every rank ``i`` (and ``max``/``min`` over ranks):

- ``memory/rank_{i}/rss_mib``, ``memory/rank_{i}/peak_rss_mib``: process resident set size, current and
  peak (always; the host memory of the process).
- ``memory/rank_{i}/allocated_mib``, ``peak_allocated_mib``, ``reserved_mib``, ``peak_reserved_mib``: the CUDA
  caching allocator's counters for the module's device (CUDA only).
- ``memory/rank_{i}/params_mib``, ``grads_mib``, ``optimizer_mib``: storages of the parameters, of their
  ``.grad`` and of the tensors in ``trainer.optimizers[*].state`` (each storage counted once).
- ``memory/rank_{i}/saved_for_backward_mib``: storages that autograd saved for backward during the most recent
  training batch, excluding parameter storages (they are in ``params_mib``). Absent when it could not be
  measured (see ``MemoryMonitor``).
- ``memory/max/<stat>`` and ``memory/min/<stat>``: the same stats reduced over ranks.

``SequenceThroughputMonitor`` logs ``throughput/tokens_per_sec`` (all ranks together, every sequence counted
once) and ``throughput/tokens_per_sec_per_rank``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

_MIB = float(2**20)

# Fixed order so that every rank packs its stats into the same slots of one float64 tensor; NaN marks a stat
# that a rank does not have (CUDA counters on CPU, saved-for-backward when it could not be measured).
STATS: tuple[str, ...] = (
    "peak_allocated_mib",
    "allocated_mib",
    "peak_reserved_mib",
    "reserved_mib",
    "peak_rss_mib",
    "rss_mib",
    "params_mib",
    "grads_mib",
    "optimizer_mib",
    "saved_for_backward_mib",
)

# (column title, stat names in order of preference): CUDA counters when present, else process RSS.
_TABLE_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Peak", ("peak_allocated_mib", "peak_rss_mib")),
    ("Current", ("allocated_mib", "rss_mib")),
    ("Params", ("params_mib",)),
    ("Grads", ("grads_mib",)),
    ("Optimizer", ("optimizer_mib",)),
    ("Saved for backward", ("saved_for_backward_mib",)),
)


def _storage_key(tensor: Tensor) -> tuple[str, int | None, int]:
    return tensor.device.type, tensor.device.index, tensor.untyped_storage().data_ptr()


def _storage_bytes(tensors: Any) -> tuple[int, set[tuple[str, int | None, int]]]:
    """Bytes of the distinct storages behind ``tensors``, and their keys."""
    seen: dict[tuple[str, int | None, int], int] = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):  # data_parallel="fsdp": this rank's shard
            tensor = tensor.to_local()
        if not isinstance(tensor, Tensor) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = _storage_key(tensor)
        if key[2] and key not in seen:
            seen[key] = storage.nbytes()
    return sum(seen.values()), set(seen)


def _peak_rss_bytes() -> float:
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _format_mib(value: float | None) -> str:
    if value is None:
        return "n/a"
    # Small models would print as a column of 0.0 with a fixed number of decimals.
    return f"{value:,.1f}" if value >= 100 else f"{value:.3g}"


def _log_dir(trainer: Trainer) -> Path:
    # Same choice as ``trainer.log_dir`` without its broadcast: this runs on rank 0 only, and a collective
    # there would hang the other ranks.
    if trainer.loggers:
        logger = trainer.loggers[0]
        path = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
    else:
        path = None
    return Path(path if path is not None else trainer.default_root_dir)


class MemoryMonitor(Callback):
    """Measure every rank's memory, log it from rank 0, and summarize it at the end of fit.

    Args:
        every_n_steps: measure when ``trainer.global_step`` is a multiple of this, and at train epoch ends.
        plot: save a bar chart ``memory_per_rank.png`` into the log directory at the end of fit.
        print_table: print a per-rank table with rich at the end of fit.

    All ranks measure in the same hooks and exchange their values with ``torch.distributed.all_gather``, so
    ``latest`` (rank -> stat -> MiB) is the same on every rank. Metric names are in the module docstring.

    Saved-for-backward is counted by a ``torch.autograd.graph.saved_tensors_hooks`` pack hook that is active
    from ``on_train_batch_start`` to ``on_train_batch_end`` and returns each tensor unchanged. For a
    ``torch.compile``'d step (checked with torch 2.13, backends eager, aot_eager and inductor) the compiled
    autograd function saves its tensors through ordinary autograd, so the hook sees what the compiled graph
    keeps for backward, after its partitioner decided what to recompute. Tensors saved inside an activation
    checkpointing region go to that region's own hooks and are not counted. If the hooks cannot be installed
    (``torch.autograd.graph.disable_saved_tensors_hooks`` is active) or the pack hook fails or is traced by
    the compiler, the stat is reported as missing and rank zero warns once.

    With spawn-based strategies (``ddp_spawn``) the hooks run in the worker processes: ``latest``, ``history``
    and ``plot_path`` of the instance in the launching process stay empty; the CSV and PNG are on disk.
    """

    def __init__(self, every_n_steps: int = 10, plot: bool = True, print_table: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.plot = plot
        self.print_table = print_table
        self.latest: dict[int, dict[str, float]] = {}
        self.history: list[tuple[int, dict[int, dict[str, float]]]] = []
        self.plot_path: Path | None = None
        self._saved: dict[tuple[str, int | None, int], int] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._saved_missing: str | None = None
        self._last_step: int | None = None

    # ---------------------------------------------------------------- saved-for-backward accounting

    def _pack(self, tensor: Tensor) -> Tensor:
        if self._saved_missing is not None:
            return tensor
        if torch.compiler.is_compiling():
            # The hook would become part of a graph and stop counting at run time.
            self._disable_saved("the pack hook was traced by torch.compile")
            return tensor
        try:
            if tensor.device.type != "meta":
                key = _storage_key(tensor)
                if key[2] and key not in self._saved:
                    self._saved[key] = tensor.untyped_storage().nbytes()
        except Exception as err:  # a statistic must never break the backward graph
            self._disable_saved(f"reading a saved tensor's storage failed ({type(err).__name__}: {err})")
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    def _disable_saved(self, reason: str) -> None:
        self._saved_missing = reason
        self._saved.clear()
        rank_zero_warn(
            f"MemoryMonitor: not counting tensors saved for backward, because {reason}; "
            "`saved_for_backward_mib` will be missing."
        )

    def _remove_hooks(self) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    # ---------------------------------------------------------------- hooks

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.latest, self.history, self.plot_path = {}, [], None
        self._last_step = None
        self._saved_missing = None  # retry, and warn again, in every fit

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A LightningModule that ends the epoch from its own on_train_batch_start skips on_train_batch_end.
        self._remove_hooks()
        self._saved.clear()
        if self._saved_missing is not None:
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            hooks.__enter__()
        except RuntimeError as err:  # raised while disable_saved_tensors_hooks is active
            self._disable_saved(f"saved tensors hooks are disabled here ({err})")
            return
        self._hooks = hooks

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._remove_hooks()
        step = trainer.global_step
        # global_step is the same on every rank, so all of them enter the collective together.
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._measure_and_log(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        if trainer.global_step != self._last_step:
            self._measure_and_log(trainer, pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.latest:
            return
        if self.print_table:
            self._print_table()
        if self.plot:
            path = _log_dir(trainer) / "memory_per_rank.png"
            self._save_plot(path)
            self.plot_path = path

    # ---------------------------------------------------------------- measurement

    def measure(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """This rank's stats in MiB (no collectives)."""
        stats: dict[str, float] = {}
        device = pl_module.device
        if device.type == "cuda":
            stats["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / _MIB
            stats["allocated_mib"] = torch.cuda.memory_allocated(device) / _MIB
            stats["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / _MIB
            stats["reserved_mib"] = torch.cuda.memory_reserved(device) / _MIB
        rss = psutil.Process().memory_info().rss
        stats["rss_mib"] = rss / _MIB
        # The kernel updates the high-water mark lazily; it can trail the current RSS by a few pages.
        peak = _peak_rss_bytes()
        if not math.isnan(peak):
            stats["peak_rss_mib"] = max(peak, rss) / _MIB

        params = list(pl_module.parameters())
        param_bytes, param_keys = _storage_bytes(params)
        stats["params_mib"] = param_bytes / _MIB
        stats["grads_mib"] = _storage_bytes(p.grad for p in params if p.grad is not None)[0] / _MIB
        state_tensors: list[Tensor] = []
        for optimizer in trainer.optimizers:
            apply_to_collection(dict(getattr(optimizer, "state", {})), Tensor, state_tensors.append)
        stats["optimizer_mib"] = _storage_bytes(state_tensors)[0] / _MIB
        if self._saved_missing is None:
            saved = sum(n for key, n in self._saved.items() if key not in param_keys)
            stats["saved_for_backward_mib"] = saved / _MIB
        return stats

    def _measure_and_log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step
        local = self.measure(trainer, pl_module)
        packed = torch.tensor([local.get(name, math.nan) for name in STATS], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # torch.distributed directly: strategy.all_gather goes through a deprecated autograd wrapper
            # (a warning on every run) and a custom strategy may override it for a subgroup.
            if torch.distributed.get_backend() != "gloo":  # NCCL and friends need device tensors
                packed = packed.to(trainer.strategy.root_device)
            gathered = [torch.empty_like(packed) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(gathered, packed)
        else:
            gathered = [packed]
        rows = [row.cpu().tolist() for row in gathered]
        self.latest = {
            rank: {name: value for name, value in zip(STATS, row) if not math.isnan(value)}
            for rank, row in enumerate(rows)
        }
        self.history.append((trainer.global_step, self.latest))
        for rank, stats in self.latest.items():
            peak = stats.get("peak_allocated_mib", stats.get("peak_rss_mib"))
            if peak is not None:  # the progress bar only: the loggers get the full breakdown below
                pl_module.log(f"peak_MiB_r{rank}", peak, prog_bar=True, logger=False, rank_zero_only=True)
        if trainer.is_global_zero:
            metrics = self._metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _metrics(self) -> dict[str, float]:
        metrics = {
            f"memory/rank_{rank}/{name}": value
            for rank, stats in self.latest.items()
            for name, value in stats.items()
        }
        for name in STATS:
            values = [stats[name] for stats in self.latest.values() if name in stats]
            if values:
                metrics[f"memory/max/{name}"] = max(values)
                metrics[f"memory/min/{name}"] = min(values)
        return metrics

    # ---------------------------------------------------------------- summary

    @staticmethod
    def _pick(stats: dict[str, float], names: tuple[str, ...]) -> float | None:
        return next((stats[name] for name in names if name in stats), None)

    def _peak_source(self) -> str:
        on_cuda = any("peak_allocated_mib" in stats for stats in self.latest.values())
        return "CUDA allocated" if on_cuda else "process RSS"

    def _print_table(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Memory per rank, MiB (peak/current: {self._peak_source()})")
        table.add_column("Rank", justify="right")
        for title, _ in _TABLE_COLUMNS:
            table.add_column(title, justify="right")
        for rank, stats in sorted(self.latest.items()):
            cells = [self._pick(stats, names) for _, names in _TABLE_COLUMNS]
            table.add_row(str(rank), *(_format_mib(cell) for cell in cells))
        Console().print(table)

    def _save_plot(self, path: Path) -> None:
        # The object-oriented API renders with Agg without switching the user's pyplot backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        ranks = sorted(self.latest)
        titles = [title for title, _ in _TABLE_COLUMNS]
        fig = Figure(
            figsize=(max(6.0, 1.2 * len(titles) * max(1, len(ranks)) ** 0.5), 4.0), layout="constrained"
        )
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        width = 0.8 / max(1, len(ranks))
        for i, rank in enumerate(ranks):
            values = [self._pick(self.latest[rank], names) for _, names in _TABLE_COLUMNS]
            xs = [x + (i - (len(ranks) - 1) / 2) * width for x in range(len(titles))]
            ax.bar(xs, [math.nan if v is None else v for v in values], width, label=f"rank {rank}")
        ax.set_xticks(range(len(titles)), titles, rotation=20, ha="right")
        ax.set_ylabel("MiB")
        step = self.history[-1][0] if self.history else 0
        ax.set_title(f"Memory per rank at step {step} (peak/current: {self._peak_source()})")
        ax.legend()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)


def _sequence_tensor(batch: Any) -> Tensor:
    """The (batch, seq) token tensor: ``input_ids``, else the first tensor with 2+ dims, integers first."""
    if (
        isinstance(batch, Mapping)
        and isinstance(batch.get("input_ids"), Tensor)
        and batch["input_ids"].dim() >= 2
    ):
        return batch["input_ids"]
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    candidates = [t for t in tensors if t.dim() >= 2]
    if not candidates:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"SequenceThroughputMonitor found no (batch, seq) tensor in the batch (tensor shapes: {shapes})."
        )
    return next((t for t in candidates if not t.is_floating_point()), candidates[0])


def global_tokens(batch: Any, *, world_size: int, sp_size: int, global_len: int | None = None) -> int:
    """Tokens that all ranks together process for ``batch``, counting each sequence once.

    The ranks of an sp group share samples, so only the ``world_size // sp_size`` data-parallel groups add
    samples: tokens = local batch size x dp groups x full sequence length. ``global_len`` overrides the
    sequence length read from the batch (whose sequence may already be this rank's shard).
    """
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"sp_size={sp_size} must be a positive divisor of world_size={world_size}.")
    tensor = _sequence_tensor(batch)
    seq_len = tensor.shape[1] if global_len is None else global_len
    return tensor.shape[0] * (world_size // sp_size) * seq_len


class SequenceThroughputMonitor(Callback):
    """Log token throughput that counts every sequence once, however many sp ranks share it.

    Args:
        sp_size: sequence-parallel group size; default ``trainer.strategy.sp_size``, else 1.
        log_every_n_steps: log after this many training batches.

    Time runs between consecutive ``on_train_batch_end`` calls (the first batch, which may compile, only
    starts the clock), minus time spent in validation. The sequence length comes from
    ``trainer.strategy.sequence_shard.global_len`` when the strategy has it, else from the batch. Every rank
    is assumed to hold the same local batch size. Rank 0 writes ``throughput/tokens_per_sec`` (progress bar)
    and ``throughput/tokens_per_sec_per_rank`` to the loggers.
    """

    def __init__(self, sp_size: int | None = None, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be at least 1, got {log_every_n_steps}.")
        self.sp_size = sp_size
        self.log_every_n_steps = log_every_n_steps
        self._reset()

    def _reset(self) -> None:
        self._window_start: float | None = None
        self._window_tokens = 0
        self._window_batches = 0
        self._paused = 0.0
        self._val_start: float | None = None

    def resolved_sp_size(self, trainer: Trainer) -> int:
        return self.sp_size if self.sp_size is not None else int(getattr(trainer.strategy, "sp_size", 1) or 1)

    def tokens_per_step(self, trainer: Trainer, batch: Any) -> int:
        """Global tokens of this training batch, each sequence counted once."""
        shard = getattr(trainer.strategy, "sequence_shard", None)
        global_len = getattr(shard, "global_len", None)
        return global_tokens(
            batch,
            world_size=trainer.world_size,
            sp_size=self.resolved_sp_size(trainer),
            global_len=global_len,
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The strategy checks its own sp_size (and chooses sp_size="auto" only after this hook).
        if self.sp_size is not None and (self.sp_size < 1 or trainer.world_size % self.sp_size):
            raise ValueError(
                f"sp_size={self.sp_size} must be a positive divisor of world_size={trainer.world_size}."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._window_start is not None:
            self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val_start is not None:
            self._paused += time.perf_counter() - self._val_start
            self._val_start = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start, self._paused = now, 0.0
            return
        self._window_tokens += self.tokens_per_step(trainer, batch)
        self._window_batches += 1
        if self._window_batches < self.log_every_n_steps:
            return
        elapsed = now - self._window_start - self._paused
        tokens_per_sec = self._window_tokens / elapsed if elapsed > 0 else math.nan
        self._window_start, self._window_tokens, self._window_batches, self._paused = now, 0, 0, 0.0
        if not trainer.is_global_zero:
            return
        metrics = {
            "throughput/tokens_per_sec": tokens_per_sec,
            "throughput/tokens_per_sec_per_rank": tokens_per_sec / trainer.world_size,
        }
        # Written to the loggers directly: self.log would only reach them on the trainer's log_every_n_steps.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        pl_module.log(
            "throughput/tokens_per_sec", tokens_per_sec, prog_bar=True, logger=False, rank_zero_only=True
        )
