"""The LightningModule's steps, compiled with the AutoSP backend: one backend per sequence layout.

The strategy compiles the steps, not the module: a loss written in ``training_step`` is then inside the
compiled region, and checkpoints keep plain parameter names (no ``_orig_mod``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._dynamo.utils import counters, guard_failures

from lightning_autosp.compiler.backend import AutoSPBackend, active_dispatch_mode, frames_not_compiled
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.data import SequenceShard

STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_LOGGING = ("log", "log_dict")
# Compiles of one step for one sequence layout (a new batch size, dtype or module flag recompiles it).
# Each layout is its own Dynamo region (``isolate_recompiles``), so distinct sequence lengths never
# count against this limit, and Dynamo's cap over all regions is raised with the number of layouts.
RECOMPILES_PER_LAYOUT = 8


class CompiledSteps:
    """Installs compiled steps on a LightningModule and keeps their backends, one per sequence layout.

    Args:
        make_backend: the backend for a layout's context (None: no sequence parallelism, sp_size=1).
        make_context: this rank's ``SPContext`` for a layout.
        current_shard: the layout of the batch being stepped on (the strategy's, set in ``batch_to_device``).
    """

    def __init__(
        self,
        make_backend: Callable[[SPContext | None], AutoSPBackend],
        make_context: Callable[[SequenceShard], SPContext],
        current_shard: Callable[[], SequenceShard | None],
    ) -> None:
        self._make_backend, self._make_context, self._current_shard = (
            make_backend,
            make_context,
            current_shard,
        )
        self._backends: dict[SequenceShard | None, AutoSPBackend] = {}
        self._originals: dict[str, Callable] = {}
        self._compiles: collections.Counter[tuple[str, SequenceShard | None]] = collections.Counter()
        self._recompile_reasons: dict[tuple[str, SequenceShard | None], list[str]] = {}

    @property
    def backends(self) -> Mapping[SequenceShard | None, AutoSPBackend]:
        return self._backends

    @property
    def compiles(self) -> Mapping[tuple[str, SequenceShard | None], int]:
        """How many times Dynamo compiled each (step, sequence layout): 1 unless a guard failed."""
        return dict(self._compiles)

    def backend_for(self, shard: SequenceShard | None) -> AutoSPBackend:
        """The compile backend for one sequence layout (Dynamo keeps one compiled graph per backend)."""
        if shard not in self._backends:
            self._backends[shard] = self._make_backend(None if shard is None else self._make_context(shard))
        return self._backends[shard]

    def install(self, module: pl.LightningModule) -> None:
        # Dynamo cannot trace Lightning's logging; calling it from a compiled step becomes a graph break.
        for name in _LOGGING:
            self._originals[name] = getattr(module, name)
            setattr(module, name, torch._dynamo.disable(getattr(module, name)))
        for name in STEPS:
            step = getattr(module, name, None)
            if step is None or name in self._originals:
                continue
            self._originals[name] = step
            setattr(module, name, self.compiled(name, step))

    def uninstall(self, module: pl.LightningModule | None) -> None:
        if module is not None:
            for name in self._originals:
                module.__dict__.pop(name, None)
        self._originals.clear()

    def compiled(self, name: str, step: Callable) -> Callable:
        """``step``, compiled on its first call for each sequence layout and checked on every call."""
        # The global sequence layout is baked into the compiled graph, and shards of one local length can
        # come from different global lengths (61 and 62 tokens both give rank 0 31 tokens), so each layout
        # gets its own backend, which Dynamo guards on, and its own Dynamo region (RECOMPILES_PER_LAYOUT).
        compiled: dict[SequenceShard | None, Callable] = {}

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # Called from another compiled step (validation_step calling self.training_step):
                # Dynamo inlines the original step into the caller's graph.
                return step(*args, **kwargs)
            shard = self._current_shard()
            mode = active_dispatch_mode()
            if shard is not None and mode is not None:
                raise RuntimeError(
                    f"{name} was called under {type(mode).__name__}, a TorchDispatchMode under which "
                    "torch.compile runs code eagerly, i.e. without sequence parallelism. Measure outside "
                    "the step (e.g. MemoryMonitor, torch.cuda.max_memory_allocated) instead."
                )
            backend = self.backend_for(shard)
            first_call = shard not in compiled
            if first_call:
                compiled[shard] = torch.compile(
                    step,
                    backend=backend,
                    dynamic=False,
                    isolate_recompiles=True,
                    recompile_limit=RECOMPILES_PER_LAYOUT,
                )
            skipped, frames_before = frames_not_compiled(), counters["frames"]["ok"]
            breaks_before = collections.Counter(counters["unimplemented"])
            with _logging_left_out(), _recompiles_limited(len(compiled)):
                try:
                    output = compiled[shard](*args, **kwargs)
                except FailOnRecompileLimitHit as error:
                    raise RuntimeError(_recompile_limit_message(name, step, shard)) from error
            if counters["frames"]["ok"] > frames_before:
                self._count_compile(name, step, shard)
            if shard is not None:
                breaks = list(counters["unimplemented"] - breaks_before)
                check_sequence_parallel_applied(name, backend, frames_not_compiled() - skipped, breaks)
            if first_call and name == "training_step" and os.environ.get("AUTOSP_DEBUG") == "1":
                rank_zero_info(
                    f"AutoSP (AUTOSP_DEBUG=1), after the first {name} of this layout:\n{self.explain()}"
                )
            return output

        return run

    def _count_compile(self, name: str, step: Callable, shard: SequenceShard | None) -> None:
        key = (name, shard)
        self._compiles[key] += 1
        if self._compiles[key] > 1:  # a recompile of a layout already compiled: say which guard failed
            reasons = guard_failures.get(_code_of(step)) or ["(Dynamo recorded no reason)"]
            self._recompile_reasons.setdefault(key, []).append(reasons[-1])

    def explain(self) -> str:
        """What the compiler did, per compiled graph: attention found, all-to-alls, rewrites, layouts."""
        lines = [
            f"{name} recompiled for sequence {'-' if shard is None else shard.global_len}: {reason}"
            for (name, shard), reasons in self._recompile_reasons.items()
            for reason in reasons
        ]
        for shard, backend in self._backends.items():
            layout = (
                "no sequence parallelism"
                if shard is None
                else f"sequence {shard.global_len} -> {shard.seq_lens}{_ring_description(shard)}"
            )
            for index, report in enumerate(backend.reports):
                lines.append(f"graph {index} ({layout}):")
                lines.extend(f"  {line}" for line in report.lines())
            lines.extend(f"{report.line()}" for report in backend.sac_reports)
            lines.extend(line for report in backend.loss_reports for line in report.lines())
        return "\n".join(lines) if lines else "Nothing compiled yet."


def _graph_break_reasons(records: Sequence[str], most: int = 3) -> str:
    """Dynamo's graph-break records (one may chain several breaks) -> each break once, as its kind, its
    explanation and the frame it skipped, on one line."""
    summaries = []
    for record in records:
        for part in record.split("another graph break occurred: ***"):
            lines = [
                line.strip() for line in part.splitlines() if line.strip() and "While handling" not in line
            ]
            explanation = next((line for line in lines if line.startswith("Explanation:")), "")
            frames = [
                line.split("frame skipped:", 1)[1].strip() for line in lines if "frame skipped:" in line
            ]
            fields = [lines[0] if lines else part, explanation.removeprefix("Explanation: ")]
            fields += [f"frame skipped: {frame}" for frame in frames]
            summaries.append(" - ".join(field for field in fields if field))
    return "; ".join(list(dict.fromkeys(summaries))[:most])


def _code_of(step: Callable) -> object:
    return getattr(inspect.unwrap(step), "__code__", None)


def _recompiles_limited(layouts: int) -> contextlib.AbstractContextManager:
    """Dynamo's limits while a step runs: a step that reaches its limit for one layout raises
    (``FailOnRecompileLimitHit``) instead of running eagerly, outside the SP pass; the cap over all
    regions of one function grows with the layouts seen (each new length is a layout)."""
    cap = max(torch._dynamo.config.accumulated_recompile_limit, RECOMPILES_PER_LAYOUT * (layouts + 1))
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, accumulated_recompile_limit=cap)


def _recompile_limit_message(name: str, step: Callable, shard: SequenceShard | None) -> str:
    reasons = guard_failures.get(_code_of(step)) or []
    layout = "this layout" if shard is None else f"sequence length {shard.global_len}"
    recent = "; ".join(reasons[-3:]) or "Dynamo recorded none"
    return (
        f"{name} was recompiled {RECOMPILES_PER_LAYOUT} times for {layout}, each time because a guard "
        f"failed (the last: {recent}). Sequence lengths are not the cause (each length has its own "
        "compile); keep what the guards name fixed between steps (a batch size: drop_last=True; a "
        "Python attribute the step reads)."
    )


def _logging_left_out() -> contextlib.AbstractContextManager:
    """Python logging inside a compiled step (HF's ``logger.warning_once`` that ``use_cache`` is turned
    off under gradient checkpointing) is left out of the trace instead of breaking the graph: a break
    inside a loop makes Dynamo run the whole frame eagerly, without sequence parallelism."""
    methods = {logging.Logger.debug, logging.Logger.info, logging.Logger.warning}
    methods |= {
        getattr(logging.Logger, name)
        for name in ("warning_once", "info_once")
        if hasattr(logging.Logger, name)
    }
    return torch._dynamo.config.patch(ignore_logging_functions=methods)


def _ring_description(shard: SequenceShard) -> str:
    if shard.ring_degree == 1:
        return ""
    layout = "contiguous" if shard.is_contiguous else "zigzag"
    return f", ulysses {shard.ulysses_degree} x ring {shard.ring_degree} ({layout})"


def check_sequence_parallel_applied(
    step_name: str, backend: AutoSPBackend, skipped_frames: int, graph_breaks: Sequence[str] = ()
) -> None:
    """Raise if part of a step ran outside the SP pass; ``graph_breaks``: Dynamo's reasons for it."""
    # Every rank runs the same graphs, so every rank raises here alike: nobody is left in a collective.
    if skipped_frames:
        reasons = _graph_break_reasons(graph_breaks)
        raise RuntimeError(
            f"torch.compile could not compile part of {step_name} ({skipped_frames} frame(s) fell back to "
            f"eager{f': {reasons}' if reasons else ''}), and code outside compiled graphs runs without "
            "sequence parallelism. Remove the graph break (TORCH_LOGS=graph_breaks shows where) or move it "
            "out of the loop."
        )
    if not backend.reports:
        raise RuntimeError(
            f"torch.compile ran {step_name} without calling the AutoSP backend (compilation disabled by "
            "TORCH_COMPILE_DISABLE or torch.compiler.disable), so sequence parallelism was not applied. "
            "Enable compilation for the step."
        )
