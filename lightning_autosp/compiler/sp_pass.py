"""The sequence-parallel (SP) pass over a Dynamo graph: prove, then rewrite.

Each rank's graph is traced on its own sequence shard [B, S_r, ...] with S_r as a symbol (Note
[Symbolic sequence lengths] in ``symbols.py``). The analysis (``analysis.py``, Note [Proving a graph
exact]) gives every value a sequence layout and lists the rewrites that make each rank compute exactly
its part of the single-device result, or refuses the graph before anything runs. Then, in order:

1. masks and token data are computed for the whole sequence where an op needs them so (``masks.py``,
   ``recompute.py``), from the graph as traced;
2. attention sees the whole sequence for a slice of the heads (``attention.py``);
3. positions and position tables count from this rank's first token (``positions.py``);
4. slices, shifts and pads along the sequence are taken of the global sequence (``slices.py``);
5. sequence lengths become numbers: global where used as values, this rank's counts as shapes;
6. reductions over the sequence become global (``losses.py``).

Before 1, every value an op needs in another layout moves there (``redistribute.py``, Note
[Redistribution] in ``analysis.py``): all-to-alls to and from split values, all-reduces of partial sums.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import eliminate_dead_code, meta_value
from lightning_autosp.compiler.lower import attention, masks
from lightning_autosp.compiler.lower.losses import losses_pass
from lightning_autosp.compiler.lower.positions import lengths_pass, positions_pass
from lightning_autosp.compiler.lower.recompute import GlobalCopier, recompute_pass
from lightning_autosp.compiler.lower.redistribute import redistribute_pass
from lightning_autosp.compiler.lower.slices import selections_pass, slices_pass
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.layout import SequenceTags, Tag
from lightning_autosp.compiler.prove.normalize import normalize_pass
from lightning_autosp.compiler.prove.plan import AttentionCall
from lightning_autosp.compiler.prove.preconditions import check_lowering
from lightning_autosp.compiler.whole_sequence import WholeLengths, local_example_inputs, whole_lengths

log = logging.getLogger(__name__)


@dataclass
class SPReport:
    """What the SP pass did to one graph, for ``AutoSPStrategy.explain()`` and tests."""

    attention: list[str] = field(default_factory=list)
    all_to_alls: int = 0
    ring_attention: list[str] = field(default_factory=list)
    replicated_kv_heads: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    positions: list[str] = field(default_factory=list)
    slices: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    redistributions: list[str] = field(default_factory=list)
    normalized: list[str] = field(default_factory=list)
    convolutions: str = ""  # which layout grouped convolutions took (Note [Windows or blocks])
    layouts: list[str] = field(default_factory=list)
    output_tags: list[Tag | None] = field(default_factory=list)
    # The sequence symbols the graph keeps (it serves every length of its class, Note [One graph for
    # every length] in symbols.py); one_length: why it serves this length only, if it does.
    length_symbols: list[sympy.Symbol] = field(default_factory=list)
    length_substitution: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)  # symbol -> G
    one_length: str = ""
    # Per output tag, its global sizes in the shard symbols (None: fixed), which the tags handed to the
    # next graph and to metrics take at each run's length; output_tags hold them at the traced length.
    output_tag_sizes: list[tuple[sympy.Expr, ...] | None] = field(default_factory=list)
    # Inputs holding the whole sequence, which the compiled graph cuts on entry (whole_sequence.py)
    whole: WholeLengths | None = None
    # Outputs that are a size in the sequence symbol: eager code after the graph reads this rank's
    # (Note [Eager code between graphs] in runtime/eager_watch.py)
    length_outputs: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [*self.normalized]
        out.append(f"attention nodes: {len(self.attention)} ({', '.join(self.attention) or 'none'})")
        out.append(f"all-to-alls inserted: {self.all_to_alls}")
        for title, items in (
            ("ring attention (K/V passed around the ring group)", self.ring_attention),
            ("KV heads replicated", self.replicated_kv_heads),
            ("cast to attention's dtype before the all-to-all", self.casts),
            ("masks", self.masks),
            ("positions made global", self.positions),
            ("sequence slices/pads made global", self.slices),
            ("token data computed for the whole sequence", self.recomputed),
            ("reductions and losses made global", self.losses),
            ("layouts", self.layouts),
        ):
            if items:
                out.append(f"{title}: {', '.join(items)}")
        if self.convolutions:
            out.append(self.convolutions)
        if self.one_length:
            out.append(f"compiled for this sequence length only: {self.one_length}")
        if self.redistributions:  # one a line: each names its op and the user's source line
            out.append("redistributed (value, from -> to, for which op, collective, bytes on this rank):")
            out.extend(f"  {line}" for line in self.redistributions)
        return out


# Why a graph traced at the whole length serves that length only (Note [Tracing at the whole sequence's
# length] in whole_sequence.py).
WHOLE_LENGTH = "traced at the whole sequence's length, its program is compiled at this rank's"


def sequence_parallel_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    ctx: SPContext,
    tags: SequenceTags,
    *,
    check_guards: bool = True,
) -> tuple[fx.GraphModule, SPReport]:
    """Prove one (sub-)graph exact under sequence sharding and rewrite it (module docstring).

    Raises:
        NotImplementedError: an op the pass cannot prove exact (all of them, with source lines and fixes).
        ValueError: the heads do not divide by the sp (Ulysses) degree.
    """
    report = SPReport()
    shape_env = symbols.graph_shape_env(gm, example_inputs)
    traced_guards = symbols.guard_count(shape_env)  # the pass must add none; it checks Dynamo's
    report.normalized = normalize_pass(gm).lines()
    analysis, report.convolutions = _cheaper_plan(
        _proven(gm, example_inputs, ctx, tags), gm, example_inputs, ctx, tags
    )
    if check_guards:
        analysis.check_guards(shape_env, traced_guards)
    analysis.raise_refusals()
    report.whole = whole_lengths(analysis.input_tags, example_inputs)
    every_length = _every_length(analysis, ctx, shape_env) if report.whole is None else WHOLE_LENGTH
    if not isinstance(every_length, tuple):  # why it serves one length, or None: it has none
        report.one_length = every_length or ""
        _specialize(gm, analysis)
    else:  # Note [One graph for every length] in symbols.py
        substitution, hints, ctx = every_length
        if check_guards:
            symbols.guard_at_global(shape_env, list(shape_env.guards)[:traced_guards], substitution)
        analysis.lower_for_every_length(shape_env, substitution, hints)
        report.length_symbols, report.length_substitution = list(substitution), dict(substitution)
    report.output_tags = list(analysis.output_tags)
    report.length_outputs = [
        n.name for n in analysis.output_nodes if isinstance(n, fx.Node) and n in analysis.sizes
    ]

    copier = GlobalCopier(gm, analysis, ctx)
    for node, call in analysis.plan.attention.items():  # whole masks first, from the graph as traced
        if isinstance(call, AttentionCall):
            mask = masks.attention_mask(copier, node, call.mask, call.heads, call.is_causal, report.masks)
            attention.set_mask(node, call, *mask)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    masks.hand_on_masks(copier, output, report.output_tags, report.masks)
    if report.length_symbols:
        report.output_tag_sizes = _tag_sizes_for_every_length(analysis, report.output_tags)
    for value, tag in zip(analysis.output_nodes, report.output_tags):  # for DDP's next bucket (analysis.py)
        if tag is not None and isinstance(meta_value(value), torch.Tensor):
            tags.mark(meta_value(value), tag)
    eliminate_dead_code(gm.graph)  # the per-rank masks replaced by whole ones (and what only they used)
    report.layouts = _explained_layouts(analysis, gm.graph)
    report.redistributions = redistribute_pass(gm, copier, ctx)
    report.all_to_alls += sum(move.via == "all_to_all" for move in analysis.plan.redistributions)
    report.recomputed = recompute_pass(copier)
    eliminate_dead_code(gm.graph)

    for node, call in analysis.plan.attention.items():
        if not isinstance(call, AttentionCall):
            attention.flash_pass(gm, call, ctx, report)
        elif call.length is not None:  # q, k, v of a sequence derived from the batch's
            lengths = ctx.shard.counts(analysis.global_value(call.length))
            attention.sdpa_pass(gm.graph, node, ctx, report, lengths)
        else:
            attention.sdpa_pass(gm.graph, node, ctx, report)
    positions_pass(gm, analysis, ctx, report.positions)
    slices_pass(gm, analysis, ctx, copier.pristine, report.slices)
    selections_pass(gm, analysis, ctx, copier.pristine, report.slices)
    lengths_pass(gm, analysis, ctx)
    losses_pass(gm, analysis, ctx, copier.pristine, report.losses)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    if report.whole is not None:  # Note [Tracing at the whole sequence's length]
        example_inputs = local_example_inputs(example_inputs, report.whole, ctx.shard)
    _refresh_fake_values(gm, example_inputs)
    return gm, report


# Note [Windows or blocks]
#     A grouped convolution along the sequence has two exact layouts: on the whole sequence for a block
#     of its groups (an all-to-all there and, where its output meets shards again, one back), or on
#     this rank's positions from a window of the neighbours' boundary rows (one all-to-all of a few
#     rows). Which costs less depends on what surrounds it, which one op's rule does not see: a short
#     convolution between projections (LFM2) comes back to shards at once, so its window saves both
#     all-to-alls; one that feeds an op needing the whole sequence anyway (a running sum over blocks of
#     heads) is cheaper moved once, before the convolution. So a graph with such a convolution is
#     analysed both ways and the plan with fewer collectives is taken (the blocks' on a tie). The count
#     decides, not the bytes: every rank of the group must choose alike, and with uneven shards the
#     bytes differ from rank to rank while the count does not. explain() shows both plans' counts and
#     this rank's bytes.
def _proven(
    gm: fx.GraphModule, example_inputs: Sequence[object], ctx: SPContext, tags: SequenceTags, **options: bool
) -> Analysis:
    """The graph's analysis, with what lowering needs beyond each op's rule checked (Note [Refusals before
    rewriting] in ``preconditions.py``)."""
    analysis = Analysis(gm, example_inputs, ctx, tags, **options).run()
    check_lowering(analysis)
    return analysis


def _cheaper_plan(
    analysis: Analysis,
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    ctx: SPContext,
    tags: SequenceTags,
) -> tuple[Analysis, str]:
    """``analysis``, or the same graph's analysis with its convolutions on windows where that plan runs
    fewer collectives (Note [Windows or blocks]); and a line for explain() saying which, if it chose."""
    if not analysis.plan.split_convolutions or analysis.refusals:
        return analysis, ""
    windowed = _proven(gm, example_inputs, ctx, tags, windows_first=True)
    if windowed.refusals:
        return analysis, ""
    blocks, windows = analysis.plan.traffic(), windowed.plan.traffic()
    chosen = windowed if windows[0] < blocks[0] else analysis
    taken = "windows" if chosen is windowed else "blocks of groups"
    line = (
        f"convolutions along the sequence on {taken}: {windows[0]} collectives ({windows[1]} bytes on this "
        f"rank) on windows, {blocks[0]} ({blocks[1]} bytes) on blocks of groups"
    )
    return chosen, line


def _every_length(
    analysis: Analysis, ctx: SPContext, shape_env: object
) -> tuple[dict[sympy.Symbol, sympy.Expr], dict[sympy.Symbol, int], SPContext] | str | None:
    """How this graph serves every length of its class (Note [One graph for every length]): each sequence
    symbol's global length in terms of itself, the symbols' traced values, and the context with this
    rank's shard as SymInts. None: the graph has no sequence length; a string: why it serves one."""
    shard = ctx.shard
    if shape_env is None or not analysis.lengths:
        return None
    if not shard.is_contiguous or shard.ring_degree != 1:
        return "a ring layout places whole chunks of tokens, computed from the length"
    for move in analysis.plan.redistributions:
        if move.via != "all_to_all":
            continue
        dim = move.source.dims[0] if move.target.is_split else move.target.dims[0]
        if analysis.shape(move.value)[dim] not in analysis.lengths:
            # Measured on a Mamba-2 scan padded to whole chunks: the partitioner's choices then differed
            # between ranks (one rank re-ran an all-to-all in backward). Kept per length until understood.
            return f"an all-to-all moves {move.value.name}, whose length is derived from the sequence's"
    hints = {symbols.raw_expr(size): symbols.hint(size) for size in _sequence_sizes(analysis)}
    world, remainder = shard.world, shard.global_len % shard.world
    substitution = {s: symbols.symbolic_global(s, world, shard.rank, remainder) for s in hints}
    if set(hints) != set(analysis.lengths) or any(
        substitution[s].subs(s, hints[s]) != analysis.lengths[s] for s in hints
    ):
        return "a sequence dim of an input was traced as an expression of its length, not the length"
    symbol = next(iter(hints))
    per_rank = symbols.symint(shape_env, symbol, hints) - int(shard.rank < remainder)
    seq_lens = tuple(per_rank + int(r < remainder) for r in range(world))
    symbolic = dataclasses.replace(shard, global_len=world * per_rank + remainder, seq_lens=seq_lens)
    return substitution, hints, dataclasses.replace(ctx, shard=symbolic)


def _tag_sizes_for_every_length(
    analysis: Analysis, output_tags: list[Tag | None]
) -> list[tuple[sympy.Expr, ...] | None]:
    """Each output tag's global sizes as expressions of the shard symbols; the tags keep their values at
    the traced length (for the next graph's compile)."""
    sizes: list[tuple[sympy.Expr, ...] | None] = []
    for index, (value, tag) in enumerate(zip(analysis.output_nodes, output_tags)):
        shape = analysis.shape(value) if isinstance(value, fx.Node) else None
        if tag is None or not tag.global_sizes or shape is None:
            sizes.append(None)
            continue
        symbolic = [analysis.global_value(shape[d]) for d in tag.layout.dims]
        sizes.append(tuple(sympy.sympify(symbols.raw_expr(size)) for size in symbolic))
        output_tags[index] = Tag(tag.layout, tuple(symbols.concrete(size) for size in symbolic))
    return sizes


def _sequence_sizes(analysis: Analysis) -> list[torch.SymInt]:
    """The sizes of the tagged inputs' sequence dims that are a sequence symbol."""
    sizes = []
    for node, tag in analysis.input_tags.items():
        value = meta_value(node)
        if not isinstance(value, torch.Tensor) or not tag.layout.is_shard:
            continue
        for dim in tag.layout.dims:
            size = value.shape[dim]
            if isinstance(size, torch.SymInt) and symbols.raw_expr(size) in analysis.lengths:
                sizes.append(size)
    return sizes


def _specialize(gm: fx.GraphModule, analysis: Analysis) -> None:
    """Fix every sequence symbol to this rank's length (Note [Symbolic sequence lengths])."""
    for size in _sequence_sizes(analysis):
        symbols.specialize(size)


def _refresh_fake_values(gm: fx.GraphModule, example_inputs: Sequence[object]) -> None:
    """Recompute every node's fake value at this rank's shapes (later passes read them)."""
    mode = next((v.fake_mode for v in example_inputs if getattr(v, "fake_mode", None) is not None), None)
    if mode is None:
        mode = getattr(torch._guards.TracingContext.try_get(), "fake_mode", None)
    if mode is None:
        return
    try:
        # Identity hooks: a user's saved-tensor hooks (MemoryMonitor's) must not run inside the compiler.
        with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x), enable_python_dispatcher():
            FakeTensorProp(gm, mode).propagate(*example_inputs)
    except Exception as error:  # shapes are a convenience for later passes, not a requirement
        log.debug("fake values not refreshed: %s", error)
        return
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def _explained_layouts(analysis: Analysis, graph: fx.Graph) -> list[str]:
    """The layouts a user cares about: positions, token data computed whole, losses and partial sums
    (those still used once the masks are whole)."""
    plan = analysis.plan
    notable = [*plan.positions, *plan.tables, *plan.recompute, *plan.losses]
    alive = set(graph.nodes)
    return [f"{node.name}={analysis.layouts.get(node)}" for node in dict.fromkeys(notable) if node in alive]
