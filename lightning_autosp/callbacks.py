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
- ``peak_MiB_r{i}``: rank ``i``'s peak (CUDA allocated, else process RSS), also shown in the progress bar.

``SequenceThroughputMonitor`` is Lightning's ``ThroughputMonitor`` with every sequence counted once however
many sp ranks share it: ``train/device/items_per_sec`` is the tokens per second of one sp group, and with
``flops_per_batch`` on the module, ``train/device/mfu`` its FLOP utilization.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_autosp.extras import require

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


def _require_plotting(package: str, option: str) -> None:
    require(package, extra="plot", needed_by=f"MemoryMonitor({option}=True)", instead=f"pass {option}=False")


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
        # Checked here, before training, rather than when fit ends and the chart or table is due.
        if plot:
            _require_plotting("matplotlib", "plot")
        if print_table:
            _require_plotting("rich", "print_table")
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
        for name, peak in self._peaks().items():
            # The progress bar's copy; the loggers get the same value from log_metrics below, at every
            # measurement rather than at Lightning's log_every_n_steps. The value is already the same on every
            # rank (gathered above): sync_dist=True says so, and rank_zero_only=True makes Lightning skip the
            # reduction it would otherwise run (and its "use sync_dist=True" warning at epoch ends).
            pl_module.log(name, peak, prog_bar=True, logger=False, sync_dist=True, rank_zero_only=True)
        if trainer.is_global_zero:
            metrics = self._metrics()
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _peaks(self) -> dict[str, float]:
        """``peak_MiB_r{rank}``: each rank's peak (CUDA allocated, else process RSS), the progress bar's."""
        peaks = {
            rank: stats.get("peak_allocated_mib", stats.get("peak_rss_mib"))
            for rank, stats in self.latest.items()
        }
        return {f"peak_MiB_r{rank}": peak for rank, peak in peaks.items() if peak is not None}

    def _metrics(self) -> dict[str, float]:
        metrics = {
            f"memory/rank_{rank}/{name}": value
            for rank, stats in self.latest.items()
            for name, value in stats.items()
        }
        metrics.update(self._peaks())
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
        _require_plotting("rich", "print_table")
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
        _require_plotting("matplotlib", "plot")
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


def _samples(batch: Any) -> int:
    return _sequence_tensor(batch).shape[0]


class SequenceThroughputMonitor(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor``, counting every sequence once however many sp ranks share it.

    Lightning counts each rank's batch and multiplies by the world size, which under sequence
    parallelism is ``sp_size`` times too much: the ranks of an sp group hold shards of the same samples.
    Here the world of Lightning's ``Throughput`` is the ``world_size // sp_size`` data-parallel groups, so
    each of its "devices" is one sp group (one replica of the model), and a batch counts its samples at
    the whole sequence length (``trainer.strategy.sequence_shard.global_len``; the batch a rank holds is
    its shard).

    Rank 0 logs, at the trainer's ``log_every_n_steps`` once ``window_size`` batches were seen, with the
    stage in front (``train/``, ``validate/``): ``device/items_per_sec`` (tokens per second of one sp
    group), ``device/samples_per_sec`` and ``device/batches_per_sec``, and, with more than one dp group,
    the same for the whole job without ``device/``. When the LightningModule has ``flops_per_batch`` (the
    FLOPs of one dp group's batch, e.g. ``lightning.fabric.utilities.throughput.measure_flops`` of the
    single-device model), also ``device/flops_per_sec``, ``flops_per_sec`` and ``device/mfu``: the sp
    group's FLOPs over the peak of its ``sp_size`` devices, i.e. their mean utilization.

    Args:
        sp_size: ranks per sequence-parallel group; default ``trainer.strategy.sp_size``, else 1.
        window_size: batches in the rolling average (the first batch, which compiles, only starts it).
        available_flops: peak FLOP/s of one device; default Lightning's figure for the device and
            precision (none on CPU, so no MFU there).
        **kwargs: other options of Lightning's ``Throughput`` (``separator``).
    """

    def __init__(
        self,
        sp_size: int | None = None,
        window_size: int = 10,
        available_flops: float | None = None,
        **kwargs: Any,
    ) -> None:
        if sp_size is not None and (not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1):
            raise ValueError(f"sp_size={sp_size!r} must be a positive int, or None for the strategy's.")
        if not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r} must be at least 2 batches (a rate needs two).")
        super().__init__(batch_size_fn=_samples, length_fn=self._tokens, window_size=window_size, **kwargs)
        self.sp_size = sp_size
        self._device_flops = available_flops
        self._strategy: Strategy | None = None  # set in setup, in the process that trains

    def resolved_sp_size(self, trainer: Trainer) -> int:
        return self.sp_size if self.sp_size is not None else int(getattr(trainer.strategy, "sp_size", 1) or 1)

    def data_parallel_size(self, trainer: Trainer) -> int:
        """The groups of ranks that draw different samples: ``world_size // sp_size``."""
        sp_size = self.resolved_sp_size(trainer)
        if trainer.world_size % sp_size:
            raise ValueError(
                f"SequenceThroughputMonitor(sp_size={sp_size}) must divide the world size "
                f"({trainer.world_size} processes); pass sp_size=None to use the strategy's."
            )
        return trainer.world_size // sp_size

    def _tokens(self, batch: Any) -> int:
        samples, seq_len = _sequence_tensor(batch).shape[:2]
        shard = getattr(self._strategy, "sequence_shard", None)
        return samples * (shard.global_len if shard is not None else seq_len)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.sp_size is not None:  # checked now; the strategy's own sp_size may not be chosen yet
            self.data_parallel_size(trainer)
        super().setup(trainer, pl_module, stage)
        self._strategy = trainer.strategy
        self._counts_dp_groups = False

    @override
    def _start(self, trainer: Trainer) -> None:
        # ThroughputMonitor made one Throughput per stage for the world size; the same for the dp groups,
        # made here: the strategy chooses sp_size="auto" in its setup, after the callbacks' setup.
        if not self._counts_dp_groups:
            dp_size = self.data_parallel_size(trainer)
            device_flops = self._device_flops or self.available_flops
            self.available_flops = device_flops * self.resolved_sp_size(trainer) if device_flops else None
            for running_stage in self._throughputs:
                self._throughputs[running_stage] = Throughput(
                    available_flops=self.available_flops, world_size=dp_size, **self.kwargs
                )
            self._counts_dp_groups = True
        super()._start(trainer)
