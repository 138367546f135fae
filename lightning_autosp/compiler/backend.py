"""The torch.compile backend: SP pass on the Dynamo graph, then AOTAutograd with SAC, then Inductor."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch._functorch.config
from functorch.compile import make_boxed_func
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import calling_like
from lightning_autosp.compiler.lower.chunked_loss import ChunkedLossReport, chunked_loss_pass
from lightning_autosp.compiler.partition.ordering import CollectiveOrder
from lightning_autosp.compiler.partition.sac import DEFAULT_TILE_BYTES, SACReport, SequenceAwarePartitioner
from lightning_autosp.compiler.prove.layout import SequenceTags, Tag, shard
from lightning_autosp.compiler.runtime.agreement import Outcome, agree, gather, graph_signature
from lightning_autosp.compiler.runtime.eager_watch import running_compiled
from lightning_autosp.compiler.sp_pass import SPReport, sequence_parallel_pass
from lightning_autosp.compiler.symbols import graph_shape_env
from lightning_autosp.compiler.whole_sequence import local_example_inputs, taking_shards

Compiler = Literal["inductor", "aot_eager"]


# What ``sac`` may be, and the partitioner's mode for each (compiler/partition/sac.py).
SAC_VALUES = (True, False, "auto", "longest")
_SAC_MODES = {True: "all", False: "off", "auto": "auto", "longest": "longest"}


def check_backend_options(
    compiler: object,
    sac: object,
    chunked_loss: object = True,
    loss_chunk_tokens: object = None,
    sac_tile_bytes: object = DEFAULT_TILE_BYTES,
    activation_budget: object = None,
    offload_activations: object = False,
) -> None:
    """Raise on a backend option value the backend does not know (before any process starts)."""
    if compiler not in ("inductor", "aot_eager"):
        raise ValueError(f"compiler={compiler!r} is not supported; use 'inductor' or 'aot_eager'.")
    if not any(sac is value or (isinstance(sac, str) and sac == value) for value in SAC_VALUES):
        raise ValueError(f"sac={sac!r} is not supported; use True, False, 'auto' or 'longest'.")
    if activation_budget is not None:
        bytes_given = isinstance(activation_budget, int) and not isinstance(activation_budget, bool)
        if not bytes_given or activation_budget < 0:
            raise ValueError(
                f"activation_budget={activation_budget!r} must be a number of bytes per rank (0 sends every "
                "layer, as sac='longest' does), or None for SAC's saves as they are."
            )
        if sac not in (True, "auto"):
            raise ValueError(
                f"activation_budget needs sac=True or sac='auto' (it is sac={sac!r}): the budget decides "
                "which layers of SAC's also rebuild attention; sac='longest' sends every layer without one."
            )
    if sac_tile_bytes is not None and (
        not isinstance(sac_tile_bytes, int) or isinstance(sac_tile_bytes, bool) or sac_tile_bytes < 0
    ):
        raise ValueError(
            f"sac_tile_bytes={sac_tile_bytes!r} must be a number of bytes (0 tiles every region wider inside "
            f"than at its edges; the default is {DEFAULT_TILE_BYTES}), or None to never tile."
        )
    if not isinstance(offload_activations, bool):
        raise TypeError(f"offload_activations={offload_activations!r} must be True or False.")
    if not isinstance(chunked_loss, bool):
        raise TypeError(f"chunked_loss={chunked_loss!r} must be True or False.")
    if loss_chunk_tokens is not None and (
        not isinstance(loss_chunk_tokens, int) or isinstance(loss_chunk_tokens, bool) or loss_chunk_tokens < 1
    ):
        raise ValueError(
            f"loss_chunk_tokens={loss_chunk_tokens!r} must be a positive number of tokens, or None for "
            "chunks of at most 2**26 logits."
        )


def _run_eagerly(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    return make_boxed_func(gm.forward)


class AutoSPBackend:
    """A ``torch.compile`` backend for one sequence layout.

    Args:
        context: this rank's shard and sp group; ``None`` runs no SP pass (sp_size=1).
        compiler: "inductor" generates code; "aot_eager" runs the same passes and partitioning
            without code generation (fast to compile; for tests and debugging).
        sac: True recomputes everything but attention and collectives in backward; "auto" recomputes
            what fits in 10% of the step's FLOPs, cheapest per byte first; "longest" recomputes
            attention and its collectives too, keeping only each layer's input (Note [Layers that
            recompute attention] in ``compiler/partition/memory_policy.py``); False saves as PyTorch's min-cut
            partitioner decides (``compiler/partition/sac.py``).
        activation_budget: with sac True or "auto", the bytes of activations a rank may keep for
            backward per graph; layers rebuild attention and its collectives until SAC's saves fit.
        chunked_loss: compute ``cross_entropy(lm_head(hidden))`` in chunks of tokens without
            materializing the logits (``compiler/lower/chunked_loss.py``); reports in ``loss_reports``.
        loss_chunk_tokens: tokens per chunk; None keeps a chunk's logits within 2**26 elements.
        sac_tile_bytes: with SAC on, a row-wise region (an MLP, its rebuild and backward) whose widest
            inner value is at least this many bytes runs over tiles of tokens, so only one tile's wide
            values are live (Note [Row tiling] in ``compiler/partition/tiling.py``); None never tiles.
        offload_activations: the values the forward saves for backward wait in host memory, copied
            out and back on a side stream on an accelerator (Note [Activation offload] in
            ``compiler/partition/offload.py``).

    Dynamo calls the backend once per graph: several times after graph breaks or when DDP splits
    the graph into buckets. Each call is rewritten on its own and leaves a report in ``reports``.
    """

    def __init__(
        self,
        context: SPContext | None,
        *,
        tags: SequenceTags | None = None,
        compiler: Compiler = "inductor",
        sac: bool | str = True,
        chunked_loss: bool = True,
        loss_chunk_tokens: int | None = None,
        sac_tile_bytes: int | None = DEFAULT_TILE_BYTES,
        activation_budget: int | None = None,
        offload_activations: bool = False,
    ) -> None:
        check_backend_options(
            compiler,
            sac,
            chunked_loss,
            loss_chunk_tokens,
            sac_tile_bytes,
            activation_budget,
            offload_activations,
        )
        self.context = context
        self.tags = tags if tags is not None else SequenceTags()
        self._guards_checked: weakref.WeakSet = weakref.WeakSet()  # shape envs whose guards were checked
        self.compiler = compiler
        self.sac = sac
        self.chunked_loss = chunked_loss
        self.loss_chunk_tokens = loss_chunk_tokens
        self.reports: list[SPReport] = []
        self.loss_reports: list[ChunkedLossReport] = []
        self.partitioner = SequenceAwarePartitioner(
            _SAC_MODES[sac],
            tile_bytes=sac_tile_bytes,
            activation_budget=activation_budget,
            offload_activations=offload_activations,
        )

    def mark_sharded(self, tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """Tag ``tensor`` as this rank's shard of the sequence along ``dim`` (default: the context's
        ``seq_dim``), as the strategy does for the batch; returns it. For compiling with this backend
        directly, without the strategy."""
        dim = self.context.seq_dim if dim is None else dim
        self.tags.mark(tensor, Tag(shard(dim), (self.context.shard.global_len,)))
        return tensor

    @property
    def sac_reports(self) -> list[SACReport]:
        return self.partitioner.reports

    @property
    def attention_count(self) -> int:
        return sum(len(report.attention) for report in self.reports)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        output_tags: list[Tag | None] = []
        if self.context is not None:
            # Dynamo's guards are checked once per trace: DDP's later buckets see the length fixed already.
            shape_env = graph_shape_env(gm, example_inputs)
            first = shape_env not in self._guards_checked
            if shape_env is not None:
                self._guards_checked.add(shape_env)
            try:
                gm, report = sequence_parallel_pass(
                    gm, example_inputs, self.context, self.tags, check_guards=first
                )
            except Exception as error:  # refused (or failed): on every rank, or none waits
                agree(Outcome(error=str(error), error_type=type(error).__name__), self.context.group_name)
                raise
            # Note [Ranks agree on their graphs]
            rewrites = [*report.attention, *report.ring_attention, *report.losses]
            agree(Outcome(graph_signature(gm, rewrites, self.context.group_roles)), self.context.group_name)
            self.reports.append(report)
            output_tags = report.output_tags
        whole = report.whole if self.context is not None else None
        if whole is not None:  # Note [Tracing at the whole sequence's length]: compiled at this rank's
            example_inputs = local_example_inputs(example_inputs, whole, self.context.shard)
        if self.chunked_loss:  # after SP: it chunks the loss of this rank's tokens
            self.loss_reports.append(ChunkedLossReport())
            chunked_loss_pass(gm, self.loss_reports[-1], chunk_tokens=self.loss_chunk_tokens)
        if self.compiler == "inductor":
            # CollectiveOrder: Note [Collective order] (ranks with uneven shards compile different sizes).
            patches = {
                "custom_partitioner_fn": self.partitioner,
                "post_grad_custom_post_pass": CollectiveOrder(),
            }
            # Note [Buffer reuse in a rebuilding backward]
            inner = compile_fx_inner if self.partitioner.mode == "off" else _backward_without_buffer_reuse
            # Note [SAC reports and the compile caches]
            with torch._functorch.config.patch(enable_autograd_cache=False):
                compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        else:
            compiled = aot_autograd(
                fw_compiler=_run_eagerly, bw_compiler=_run_eagerly, partition_fn=self.partitioner
            )(gm, example_inputs)
        if whole is not None:
            compiled = taking_shards(compiled, whole, self.context.shard)
        if self.context is None:
            return compiled
        share_length_guards(report, graph_shape_env(gm, example_inputs), self.context.group_name)
        compiled = running_compiled(compiled)  # Note [Eager code between graphs] in eager_watch.py
        if not any(output_tags):
            return compiled
        if not report.length_symbols or not any(report.output_tag_sizes):
            return tagging_outputs(compiled, lambda: output_tags, self.tags)
        sizes, lengths = report.output_tag_sizes, report.length_symbols

        @functools.cache
        def tags_at(local_len: int) -> list[Tag | None]:  # once per length, not per step
            local = {symbol: local_len for symbol in lengths}
            return [
                tag if exprs is None else Tag(tag.layout, tuple(symbols.evaluate(e, local) for e in exprs))
                for tag, exprs in zip(output_tags, sizes)
            ]

        def tags_now() -> list[Tag | None]:  # at the length of the batch at hand (the context's)
            return tags_at(self.context.shard.local_len)

        return tagging_outputs(compiled, tags_now, self.tags)


def share_length_guards(report: SPReport, shape_env: object, group_name: str) -> None:
    """Make the ranks of the sp group recompile a graph for every length at the same lengths (Note [Ranks
    agree on their graphs]): each installs every rank's guards. A compile that fixed the length on some
    rank (an ``int()`` of a size somewhere) fixes it on every rank, and the report says so, so the step
    compiles per length from then on."""
    substitution = report.length_substitution
    pinned = symbols.pinned_symbols(shape_env, report.length_symbols) if substitution else []
    why = f"compiling it fixed the length ({symbols.pinning_guard(shape_env, pinned)})" if pinned else ""
    conditions = symbols.guards_on_global(shape_env, substitution) if substitution and not pinned else []
    shared = gather((why, conditions) if substitution else None, group_name)
    if not any(shared):
        return
    why = next((w for w, _ in filter(None, shared) if w), "")
    if why:
        for symbol in report.length_symbols:
            symbols.specialize_symbol(shape_env, symbol)
        report.one_length, report.length_symbols = why, []
        return
    symbols.install_guards(
        shape_env, [c for _, rank_conditions in shared for c in rank_conditions], substitution
    )


def tagging_outputs(
    compiled: Callable, output_tags: Callable[[], list[Tag | None]], tags: SequenceTags
) -> Callable:
    """``compiled``, tagging each output with its layout for the graph after it (Note [Sequence layouts]);
    with DDP's buckets also when DDP runs it on fake tensors to trace the next bucket. ``output_tags``
    gives the tags of this run (their sizes follow the length where one graph serves several)."""

    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        for output, tag in zip(outputs, output_tags()):
            if tag is not None and isinstance(output, torch.Tensor):
                tags.mark(output, tag)
        return outputs

    return calling_like(compiled, run)


def _backward_without_buffer_reuse(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner``, without buffer reuse when it compiles a backward graph."""
    if not kwargs.get("is_backward", False):
        return compile_fx_inner(gm, example_inputs, **kwargs)
    with torch._inductor.config.patch(allow_buffer_reuse=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


# Note [Buffer reuse in a rebuilding backward]
# Inductor's wrapper lets a buffer it frees wait for a later buffer of the same size, which then takes
# its memory instead of allocating, when its estimate of the graph's peak says that holding the freed
# buffer until then costs nothing. The estimate counts Inductor's own buffers, not what an extern kernel
# allocates inside itself: attention's backward allocates its zero-filled gradients, a contiguous copy of
# dO and a workspace. With SAC, backward runs each layer as: rebuild the MLP, its backward, attention's
# backward, then the layer below's rebuild, whose [S/P, 4h] values would take the MLP buffers freed above.
# So those buffers stay held through attention's backward, which is where the step's peak is. With SAC on,
# backward therefore frees every buffer at its last use (the forward, whose peak is not the step's, keeps
# reuse). Without SAC the peak is where backward starts, among the saved activations, and reuse lowers it
# there (the 8-layer Llama at 2048 tokens on 2 ranks: 62.7 MiB with it, 64.3 without), so it stays on.
# With SAC, same model, fp32: 4 ranks 18.9 -> 15.7 MiB (highest rank and step), 2 ranks 24.7 -> 23.2;
# bf16-mixed on 2 ranks at 4352 tokens 32.3 -> 30.5 MiB; step times unchanged within their spread, except
# at small sizes, where the fresh allocations show on CPU (Llama-3's proportions in bf16 at 2048 tokens:
# 5% slower, for 17.1 -> 14.9 MiB). The trainable length is what SAC is for, so the lower peak wins.


# Note [SAC reports and the compile caches]
# A hit in AOTAutograd's cache hands back the compiled forward and backward without partitioning the
# joint graph again, so the partitioner would leave no SACReport and explain() none for that graph. Our
# compiles skip that cache: the joint graph is traced and partitioned in every process (seconds), while
# Inductor's FX graph cache, keyed on the partitioned graphs, still serves the generated code (the
# minutes of a compile). SequenceAwarePartitioner.uuid() covers every SAC setting, for both caches.


def frames_not_compiled() -> int:
    """Frames Dynamo has given up on so far in this process (e.g. a graph break inside a loop).

    Such a frame runs eagerly, outside every SP rewrite, so the strategy checks this count around
    each compiled step.
    """
    frames = counters["frames"]
    return frames["total"] - frames["ok"]


def active_dispatch_mode() -> object | None:
    """The active ``TorchDispatchMode`` (MemTracker, FlopCounterMode, ...), if any.

    Dynamo runs a compiled function eagerly while one is active, without counting a skipped frame,
    and keeps that code eager afterwards, so the strategy refuses to run a step under one.
    """
    return _get_current_dispatch_mode()
