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
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch._functorch.config
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit
from torch._dynamo.utils import counters, guard_failures

from lightning_autosp.compiler.backend import AutoSPBackend, active_dispatch_mode, frames_not_compiled
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.prove.plan import LengthBranchRefusal, SequenceParallelRefusal
from lightning_autosp.compiler.runtime.eager_watch import EagerWatch, graph_breaks_inside_the_watch
from lightning_autosp.data import LengthClass, SequenceShard, shard_batch

# What one compiled graph serves: a length class (every length with the same remainder over the sp
# ranks, Note [One graph for every length]), one layout (ring layouts, or a step whose rewrites need
# the number), or None without sequence parallelism.
Region = LengthClass | SequenceShard | None

STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_LOGGING = ("log", "log_dict")
# Compiles of one step for one region (a new batch size, dtype or module flag recompiles it). Each region
# is a Dynamo region of its own (``isolate_recompiles``), so lengths of another class never count against
# this limit, and Dynamo's cap over all regions is raised with the number of regions.
RECOMPILES_PER_LAYOUT = 8


class CompiledSteps:
    """Installs compiled steps on a LightningModule and keeps their backends, one per region: a length
    class, whose graph serves every length in it, or one layout where a graph needs the number.

    Args:
        make_backend: the backend for a layout's context (None: no sequence parallelism, sp_size=1).
        make_context: this rank's ``SPContext`` for a layout.
        current_shard: the layout of the batch being stepped on (the strategy's, set in ``batch_to_device``).
        whole_batch: the batch being stepped on, whole and tagged so, once the steps are to be traced at the
            whole sequence's length from now on (None where they are not: trace_length="shard"); called
            when a step is refused for a branch on the length.
    """

    def __init__(
        self,
        make_backend: Callable[[SPContext | None], AutoSPBackend],
        make_context: Callable[[SequenceShard], SPContext],
        current_shard: Callable[[], SequenceShard | None],
        whole_batch: Callable[[], Any] = lambda: None,
    ) -> None:
        self._make_backend, self._make_context, self._current_shard = (
            make_backend,
            make_context,
            current_shard,
        )
        self._whole_batch = whole_batch
        self._backends: dict[Region, AutoSPBackend] = {}
        self._originals: dict[str, Callable] = {}
        self._compiles: collections.Counter[tuple[str, Region]] = collections.Counter()
        self._recompile_reasons: dict[tuple[str, Region], list[str]] = {}
        self._per_length: dict[str, str] = {}  # step -> why its graphs serve one length each
        self._seen: dict[Region, dict[SequenceShard, None]] = collections.defaultdict(dict)

    @property
    def backends(self) -> Mapping[Region, AutoSPBackend]:
        return self._backends

    @property
    def compiles(self) -> Mapping[tuple[str, Region], int]:
        """How many times Dynamo compiled each (step, region): 1 unless a guard failed."""
        return dict(self._compiles)

    def region_of(self, name: str | None, shard: SequenceShard | None) -> Region:
        if shard is None:
            return None
        if shard.length_class is None or name in self._per_length:
            return shard
        return shard.length_class

    def backend_for(self, shard: SequenceShard | None, name: str | None = None) -> AutoSPBackend:
        """The compile backend of ``shard``'s region (Dynamo keeps one compiled graph per backend); a
        length class's backend compiles for the length of the batch at hand."""
        region = self.region_of(name, shard)
        backend = self._backends.get(region)
        if backend is None:
            backend = self._make_backend(None if shard is None else self._make_context(shard))
            self._backends[region] = backend
        elif isinstance(region, LengthClass) and backend.context.shard != shard:
            backend.context = self._make_context(shard)  # what a recompile (a guard failed) traces
        return backend

    def install(self, module: pl.LightningModule) -> None:
        install_output_capturing_hooks(module)
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
        """``step``, compiled on its first call for each region and checked on every call."""
        # Shards of one local length come from lengths of different classes (61 and 62 tokens both give
        # rank 0 31 tokens), whose graphs differ, so each region gets its own backend and Dynamo region.
        compiled: dict[Region, Callable] = {}

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
            backend = self.backend_for(shard, name)
            region = self.region_of(name, shard)
            self._seen[region][shard] = None
            first_call, graphs_before = region not in compiled, len(backend.reports)
            started = time.perf_counter()
            if first_call:
                rank_zero_info(f"AutoSP: compiling {name} ({_region_description(region)})")
                compiled[region] = torch.compile(
                    step,
                    backend=backend,
                    dynamic=False,
                    isolate_recompiles=True,
                    recompile_limit=RECOMPILES_PER_LAYOUT,
                )
            skipped, frames_before = frames_not_compiled(), counters["frames"]["ok"]
            breaks_before = collections.Counter(counters["unimplemented"])
            graph_breaks_before = collections.Counter(counters["graph_break"])
            whole = None
            # Note [Eager code between graphs]
            watched = shard is not None
            watch = EagerWatch(backend.tags) if watched else contextlib.nullcontext()
            breaks_inside = graph_breaks_inside_the_watch() if watched else contextlib.nullcontext([])
            with (
                _tracing_settings(),
                _recompiles_limited(len(compiled)),
                _collectives_kept_apart(),
                watch,
                breaks_inside as blind_breaks,
            ):
                try:
                    output = compiled[region](*args, **kwargs)
                except FailOnRecompileLimitHit as error:
                    raise RuntimeError(_recompile_limit_message(name, step, region)) from error
                except BackendCompilerFailed as error:
                    refusal = error.inner_exception
                    # Note [Tracing at the whole sequence's length]: every rank got this refusal alike; a
                    # step broken into graphs keeps it (eager code between them holds this rank's part)
                    new_breaks = counters["graph_break"] - graph_breaks_before
                    broken = bool(new_breaks or counters["unimplemented"] - breaks_before)
                    retry = isinstance(refusal, LengthBranchRefusal) and args and not broken
                    whole = self._whole_batch() if retry else None
                    if broken and isinstance(refusal, LengthBranchRefusal):
                        refusal = LengthBranchRefusal(
                            f"{refusal}\nNot traced again at the whole sequence's length: the step is broken "
                            "into several graphs (TORCH_LOGS=graph_breaks shows where), and the eager code "
                            "between them holds this rank's part of the values. Remove the graph break."
                        )
                    # The refusal is the message: Dynamo's wrapper and its advice on its own logs are noise.
                    if whole is None and isinstance(refusal, SequenceParallelRefusal):
                        raise refusal.with_traceback(None) from None
                    if whole is None:
                        raise
            if whole is not None:
                rank_zero_info(
                    f"AutoSP: {name} branches on the sequence length; tracing it at the whole length"
                )
                try:
                    return run(whole, *args[1:], **kwargs)
                except SequenceParallelRefusal:
                    raise
                except Exception as failure:  # the same trace on every rank: the same failure
                    first_line = (str(failure).splitlines() or [""])[0]
                    raise LengthBranchRefusal(
                        f"{refusal}\nTraced again at the whole sequence's length, the step failed: "
                        f"{type(failure).__name__}: {first_line}"
                    ) from None
            if counters["frames"]["ok"] > frames_before:
                self._count_compile(name, step, region)
                seconds = time.perf_counter() - started
                rank_zero_info(f"AutoSP: compiled {name} ({_region_description(region)}) in {seconds:.1f} s")
                one_length = [r.one_length for r in backend.reports[graphs_before:] if r.one_length]
                if isinstance(region, LengthClass) and one_length:
                    self._per_length[name] = one_length[0]  # the next length gets a region of its own
            if shard is not None:
                check_sequence_parallel_applied(
                    name,
                    backend,
                    EagerEvidence(
                        skipped_frames=frames_not_compiled() - skipped,
                        graph_breaks=list(counters["unimplemented"] - breaks_before),
                        blind_breaks=blind_breaks,
                        eager_calls=watch.calls,
                        length_outputs=[
                            f"{output} of graph {index}"
                            for index, report in enumerate(backend.reports)
                            if index >= graphs_before
                            for output in report.length_outputs
                        ],
                    ),
                )
            if first_call and name == "training_step" and os.environ.get("AUTOSP_DEBUG") == "1":
                rank_zero_info(
                    f"AutoSP (AUTOSP_DEBUG=1), after the first {name} of this layout:\n{self.explain()}"
                )
            return output

        return run

    def _count_compile(self, name: str, step: Callable, region: Region) -> None:
        key = (name, region)
        self._compiles[key] += 1
        if self._compiles[key] > 1:  # a recompile of a layout already compiled: say which guard failed
            reasons = guard_failures.get(_code_of(step)) or ["(Dynamo recorded no reason)"]
            self._recompile_reasons.setdefault(key, []).append(reasons[-1])

    def explain(self) -> str:
        """What the compiler did, per compiled graph: attention found, all-to-alls, rewrites, layouts."""
        lines = [
            f"{name} recompiled for {_region_description(region)}: {reason}"
            for (name, region), reasons in self._recompile_reasons.items()
            for reason in reasons
        ]
        lines += [f"{name}: one graph per length, because {why}" for name, why in self._per_length.items()]
        for region, backend in self._backends.items():
            layout = _region_description(region)
            if isinstance(region, LengthClass):
                seen = [f"{shard.global_len} -> {shard.seq_lens}" for shard in self._seen[region]]
                more = f" and {len(seen) - 4} more" if len(seen) > 4 else ""
                layout += f"; one graph for {', '.join(seen[:4])}{more}"
            for index, report in enumerate(backend.reports):
                lines.append(f"graph {index} ({layout}):")
                lines.extend(f"  {line}" for line in report.lines())
            # one partition per compiled graph, in compile order: say which graph each SAC line is about
            sac = backend.sac_reports
            lines.extend(f"graph {index}: {report.line()}" for index, report in enumerate(sac))
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


def _region_description(region: Region) -> str:
    if region is None:
        return "no sequence parallelism"
    if isinstance(region, LengthClass):
        return f"sequence lengths: {region}"
    return f"sequence {region.global_len} -> {region.seq_lens}{_ring_description(region)}"


def _recompile_limit_message(name: str, step: Callable, region: Region) -> str:
    reasons = guard_failures.get(_code_of(step)) or []
    recent = "; ".join(reasons[-3:]) or "Dynamo recorded none"
    return (
        f"{name} was recompiled {RECOMPILES_PER_LAYOUT} times for {_region_description(region)}, each "
        f"time because a guard failed (the last: {recent}). Keep what the guards name fixed between "
        "steps (a batch size: drop_last=True; a Python attribute the step reads); a guard on a sequence "
        "length is a branch the model or a rewrite takes on it."
    )


def _tracing_settings() -> contextlib.AbstractContextManager:
    """Dynamo settings that keep a model's Python bookkeeping from breaking the graph: a break inside a loop
    makes Dynamo run the whole frame eagerly, without sequence parallelism.

    - Python logging is left out of the trace (HF's ``logger.warning_once`` that ``use_cache`` is turned
      off under gradient checkpointing).
    - Python state a checkpointed region sets is set once, in forward, not again when backward recomputes:
      the SP pass inlines every checkpointed region (``compiler/prove/normalize.py``) and SAC recomputes
      graph ops only, so nothing replays the region's Python code either way. transformers (from 5.25) sets
      and resets a context variable in each attention's forward (``kernels``' ``use_kernelized_func``),
      which under ``gradient_checkpointing_enable()`` otherwise breaks the graph at every layer.
    """
    methods = {logging.Logger.debug, logging.Logger.info, logging.Logger.warning}
    methods |= {
        getattr(logging.Logger, name)
        for name in ("warning_once", "info_once")
        if hasattr(logging.Logger, name)
    }
    return torch._dynamo.config.patch(
        ignore_logging_functions=methods, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )


# Note [Collectives kept apart]
#     AOTAutograd's partitioner merges nodes of the joint graph that compute the same op on the same inputs
#     (its common-subexpression pass, ``torch._functorch.config.cse``), and a functional collective is such
#     a node to it. Two collectives can look alike on one rank only: a rank that sends nothing in two
#     windows of the label shift (sp rank 0 of ``ids[:, 1:]`` in the step and of HF's padded labels in its
#     loss) passes the same empty buffer and splits to both, while the rank that sends to it passes two
#     different tensors. The first rank then runs one all-to-all fewer than the second: each waits in a
#     different collective (a metric's all-gather against the graph's all-to-all) until the timeout. The
#     ranks agree on their graphs before the partitioner runs (Note [Ranks agree on their graphs]), so
#     the steps compile without that pass: every collective the SP pass wrote runs on every rank. The cost
#     is whatever else the pass would have merged that Inductor does not (a repeated subgraph computed
#     twice): for the tests' Llama and GPT under Inductor + SAC, SAC's saved bytes, the all-to-alls and
#     the gradients came out the same with and without it; step time on a GPU is not measured yet. A pass
#     that leaves collectives alone would keep the rest.


def install_output_capturing_hooks(module: torch.nn.Module) -> None:
    """Install transformers' output-capturing hooks on composite models (vision- and audio-language) now.

    A composite model reads its tower's hidden states, and transformers installs the hooks that collect
    them on the first call that asks, under a ``threading.Lock``: Dynamo cannot trace into a lock, so the
    first compiled step would run that frame eagerly, without sequence parallelism. Installed here, the
    first call finds them installed, as every later call does. Models whose config has no sub-configs
    (a causal LM alone) never ask, and are left as they are.
    """
    transformers = sys.modules.get("transformers")  # only a model built with transformers can need them
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if transformers is None or capturing is None:
        return
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if isinstance(sub, transformers.PreTrainedModel) and getattr(config, "sub_configs", None):
            capturing.maybe_install_capturing_hooks(sub)


def _collectives_kept_apart() -> contextlib.AbstractContextManager:
    """Compile without AOTAutograd's common-subexpression pass (Note [Collectives kept apart])."""
    return torch._functorch.config.patch(cse=False)


def _ring_description(shard: SequenceShard) -> str:
    if shard.ring_degree == 1:
        return ""
    layout = "contiguous" if shard.is_contiguous else "zigzag"
    return f", ulysses {shard.ulysses_degree} x ring {shard.ring_degree} ({layout})"


@dataclass(frozen=True)
class EagerEvidence:
    """What one call of a step ran outside the SP pass (Note [Eager code between graphs])."""

    skipped_frames: int  # frames Dynamo gave up on: they ran eagerly
    graph_breaks: Sequence[str] = ()  # Dynamo's reasons, for every break and frame given up on
    blind_breaks: Sequence[str] = ()  # Dynamo's reasons for breaks on a torch call, whose call the watch
    # cannot see (graph_breaks_inside_the_watch)
    eager_calls: Sequence[str] = ()  # torch calls outside the graphs on sequence data (EagerWatch)
    length_outputs: Sequence[str] = ()  # graph outputs that hand eager code this rank's length

    def unseen(self) -> list[str]:
        """Why the eager code of frames Dynamo gave up on may hold sequence data the watch cannot see."""
        other = [_break_kind(b) for b in self.blind_breaks if not _reads_one_value(b)]
        why = [f"a graph break on a torch call the watch cannot see into ({other[0]})"] if other else []
        if self.length_outputs:
            why.append(f"a sequence length handed to eager code ({', '.join(self.length_outputs)})")
        return why


def _break_kind(reason: str) -> str:
    """Dynamo's name for a graph break, from its reason (``Encountered graph break when ...:`` first)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith("Encountered graph break")), reason)


def _reads_one_value(reason: str) -> bool:
    """Whether Dynamo's reason for a graph break on a torch call is a read of a tensor's value as a Python
    number (``bool``, ``item``: ``_local_scalar_dense``), which one device can do only to a tensor of one
    element (Note [Eager code between graphs])."""
    kind = _break_kind(reason)
    return kind == "Data-dependent branching" or (
        kind == "Data dependent operator" and "`aten._local_scalar_dense.default`" in reason
    )


def check_sequence_parallel_applied(step_name: str, backend: AutoSPBackend, evidence: EagerEvidence) -> None:
    """Raise if part of a step computed on sequence data outside the SP pass, or may have."""
    # Every rank runs the same graphs and Python, so every rank raises here alike: nobody is left in a
    # collective.
    fell_back = ""
    if evidence.skipped_frames:
        reasons = _graph_break_reasons(evidence.graph_breaks)
        reasons = f": {reasons}" if reasons else ""
        fell_back = f" ({evidence.skipped_frames} frame(s) fell back to eager{reasons})"
    if evidence.eager_calls:
        raise RuntimeError(
            f"{step_name} computed on this rank's part of the sequence outside the compiled graphs"
            f"{fell_back}: {'; '.join(evidence.eager_calls)}. Code that runs eagerly (a frame torch.compile "
            "could not compile, a function under torch.compiler.disable) sees this rank's tokens only. "
            "Remove the graph break (TORCH_LOGS=graph_breaks shows where) or move it out of the loop."
        )
    unseen = evidence.unseen() if evidence.skipped_frames else []
    if unseen:
        raise RuntimeError(
            f"torch.compile could not compile part of {step_name}{fell_back}, and code outside compiled "
            f"graphs runs without sequence parallelism; AutoSP cannot tell that it leaves the sequence "
            f"alone: {'; '.join(unseen)}. Remove the graph break (TORCH_LOGS=graph_breaks shows where) or "
            "move it out of the loop."
        )
    if not backend.reports:
        raise RuntimeError(
            f"torch.compile ran {step_name} without calling the AutoSP backend (compilation disabled by "
            "TORCH_COMPILE_DISABLE or torch.compiler.disable), so sequence parallelism was not applied. "
            "Enable compilation for the step."
        )


def shard_and_tag(
    batch: Any, tags: SequenceTags, whole: bool, **shard_options: Any
) -> tuple[Any, SequenceShard]:
    """This rank's slice of ``batch`` (``whole``: all of it, for the compiled step to cut, Note [Tracing at
    the whole sequence's length]) and its layout, tagged for the compiler, which reads which tensors hold
    the sequence from the tags, not from their sizes. Raises the length rule (data.check_sequence_length)
    alike on every rank, before any tensor is sliced: the ranks' samples agree."""
    sharded: list[tuple[torch.Tensor, int]] = []
    batch, shard = shard_batch(
        batch, on_shard=lambda tensor, dim: sharded.append((tensor, dim)), whole=whole, **shard_options
    )
    tags.mark_batch(batch, sharded, shard.global_len, whole=whole)
    return batch, shard
