"""Lowering of the analysis' redistributions (Note [Redistribution] in ``analysis.py``).

Each ``Redistribution`` names a value, the op that needs it, and the layout it needs; this pass inserts
the move in front of that op and points the op at it. A value several ops need in the same layout moves
once. Before (``x`` sharded along the sequence, ``cumsum`` along it)::

    x [B, S_r, C] -> cumsum(1) -> [B, S_r, C]

After (split over the channels, C / P each)::

    x [B, S_r, C] -> seq_to_head(2, 1) -> [B, S, C/P] -> cumsum(1) -> head_to_seq(2, 1) -> [B, S_r, C]

Ops on split values whose arguments spell out sizes (views, expands) get this rank's sizes: the whole
sequence, 1/P of the split dim. Grouped convolutions on split channels run 1/P of their groups.
Convolutions along the sequence on shards read a window with the neighbours' boundary rows (Note
[Windows of the sequence] in ``ops.py``)::

    x [N, C, S_r] -> conv1d(padding=p) -> [N, C, S_r']

becomes::

    x [N, C, S_r] -> sequence_window(2, ...) -> [N, C, S_r' + e] -> conv1d(padding=0) -> [N, C, S_r']

(e: dilation * (kernel - 1); S_r': the output positions this rank owns). Tokens joined to the sequence
likewise: ``cat([prefix, x], 1)`` -> ``sequence_window(x, 1, ..., prefix)``, this rank's positions of the
longer sequence.
"""

from __future__ import annotations

import torch
from torch import fx

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import bind, call, meta_value, op_name, source_line, with_sizes
from lightning_autosp.compiler.lower.recompute import GlobalCopier
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.plan import (
    ConvolutionWindow,
    Redistribution,
    TokenInsertion,
)
from lightning_autosp.compiler.prove.rules.products import conv_signature
from lightning_autosp.compiler.runtime import ops


def redistribute_pass(gm: fx.GraphModule, copier: GlobalCopier, ctx: SPContext) -> list[str]:
    """Insert every move the plan lists; returns a line per move for ``explain()``."""
    analysis, graph = copier.analysis, gm.graph
    moved: dict[tuple[fx.Node, object, str], fx.Node] = {}
    current: dict[tuple[fx.Node, fx.Node], fx.Node] = {}  # (value, user) -> what the user reads now
    lines = []
    for move in analysis.plan.redistributions:
        if move.user not in graph.nodes:
            continue
        source = current.get((move.value, move.user), move.value)
        key = (source, move.target, move.via)
        if key not in moved:
            moved[key] = _move(graph, copier, ctx, move, source)
        move.user.replace_input_with(source, moved[key])
        current[(move.value, move.user)] = moved[key]
        lines.append(str(move))
    _local_sizes(graph, analysis, ctx)
    for node, groups in analysis.plan.split_convolutions.items():
        args = bind(node, conv_signature(node))
        args["groups"] = groups
        node.args, node.kwargs = tuple(args.values()), {}
    for node, window in analysis.plan.windows.items():
        if node in graph.nodes:
            lines.append(_window_convolution(graph, analysis, ctx, node, window))
    for node, inserted in analysis.plan.insertions.items():
        if node in graph.nodes:
            lines.append(_insert_tokens(graph, analysis, ctx, node, inserted))
    return lines


def _insert_tokens(
    graph: fx.Graph, analysis: Analysis, ctx: SPContext, node: fx.Node, inserted: TokenInsertion
) -> str:
    """``cat([prefix..., x, suffix...])`` along the sequence -> this rank's positions of the joined
    sequence (as ``SequenceShard.owned_range`` owns a longer sequence's): a window of ``x`` shifted by
    the prefix's length, the prefix and suffix where it passes x's ends."""
    tensors = list(node.args[0] if node.args else node.kwargs["tensors"])
    source, prefix, suffix = tensors[inserted.index], tensors[: inserted.index], tensors[inserted.index + 1 :]
    length = analysis.global_value(analysis.shape(source)[inserted.dim])
    owned = ctx.shard.owned_ranges(length + inserted.before + inserted.after)
    windows = [(first - inserted.before, stop - inserted.before) for first, stop in owned]
    with graph.inserting_before(node):
        fills = [call(graph, torch.cat, (t, inserted.dim)) if t else None for t in (prefix, suffix)]
    comm = (*ctx.window_args(windows, length), *fills)
    window = _insert(graph, ops.sequence_window, (source, inserted.dim, *comm), before=node)
    window.meta["example_value"] = meta_value(node)  # the joined sequence, as traced
    node.replace_all_uses_with(window)
    graph.erase_node(node)
    return (
        f"{source.name} {analysis.layouts.get(source)} -> joined with {inserted.before} tokens before and "
        f"{inserted.after} after at {source_line(node)}: all-to-all of the neighbours' boundary rows"
    )


def _window_convolution(
    graph: fx.Graph, analysis: Analysis, ctx: SPContext, node: fx.Node, window: ConvolutionWindow
) -> str:
    """Feed ``node`` the window of its input its outputs read and drop its padding along the sequence:
    it then gives the output positions this rank owns (as every sequence-derived length is owned,
    ``SequenceShard.owned_range``)."""
    args = bind(node, conv_signature(node))
    source = args["input"]
    length = analysis.global_value(analysis.shape(source)[window.dim])
    out_length = window.output_length(length)
    owned = ctx.shard.owned_ranges(out_length)  # every rank owns some (Note [Refusals before rewriting])
    comm = ctx.window_args([window.window(first, stop) for first, stop in owned], length)
    args["input"] = _insert(graph, ops.sequence_window, (source, window.dim, *comm), before=node)
    padding = args["padding"]
    spatial_dims = meta_value(args["weight"]).dim() - 2
    if isinstance(padding, str):  # "valid", or "same" over the sequence alone (the rule checked)
        padding = 0
    padding = list(padding) if isinstance(padding, (tuple, list)) else [padding] * spatial_dims
    padding[window.spatial] = 0
    args["padding"] = tuple(padding)
    node.args, node.kwargs = tuple(args.values()), {}
    return (
        f"{source.name} {analysis.layouts.get(source)} -> window of {window.pad_before} positions before and "
        f"{window.extent - window.pad_before} after for {op_name(node)} at {source_line(node)}: all-to-all "
        "of the neighbours' boundary rows"
    )


def _move(graph: fx.Graph, copier: GlobalCopier, ctx: SPContext, move: Redistribution, x: fx.Node) -> fx.Node:
    source, target = move.source, move.target
    if move.via == "recompute":  # token data: the whole sequence, then this rank's block
        whole = copier.copy(move.value)
        return _block(graph, whole, target, ctx, before=move.user) if target.is_split else whole
    if move.via == "narrow":
        return _block(graph, x, target, ctx, before=move.user)
    if move.via == "all_reduce":
        return _insert(graph, ops.all_reduce_sum, (x, ctx.group_name), before=move.user)
    if move.via == "all_gather":
        return _insert(
            graph, ops.gather_blocks, (x, source.split, ctx.shard.world, ctx.group_name), before=move.user
        )
    # A sequence-derived length (padded to a multiple of a chunk, shifted) splits as its positions do.
    sequence_dim = source.dims[0] if target.is_split else target.dims[0]
    length = copier.analysis.global_value(copier.analysis.shape(move.value)[sequence_dim])
    comm = (ctx.shard.counts(length), ctx.shard.rank, ctx.group_name)
    if target.is_split:  # shard -> split
        return _insert(graph, ops.seq_to_head, (x, target.split, sequence_dim, *comm), before=move.user)
    return _insert(graph, ops.head_to_seq, (x, source.split, sequence_dim, *comm), before=move.user)


def _block(graph: fx.Graph, x: fx.Node, target, ctx: SPContext, *, before: fx.Node) -> fx.Node:
    """This rank's block of ``x`` along the split dim of ``target``."""
    per_rank = int(meta_value(x).shape[target.split]) // ctx.shard.world
    return _insert(graph, torch.narrow, (x, target.split, ctx.shard.rank * per_rank, per_rank), before=before)


def _insert(graph: fx.Graph, target: object, args: tuple, *, before: fx.Node) -> fx.Node:
    """A move, recorded with its input's traced value: values keep their traced shapes (this rank's
    tokens, every head) until the pass ends and propagates real ones, whatever their layout."""
    with graph.inserting_before(before):
        node = graph.call_function(target, with_sizes(graph, args))
    node.meta["example_value"] = meta_value(args[0])
    return node


def _local_sizes(graph: fx.Graph, analysis: Analysis, ctx: SPContext) -> None:
    """Views and expands of split values take this rank's sizes: every length global, 1/P of the split
    dim (the traced sizes are this rank's tokens of every head)."""
    for node in analysis.plan.split_shapes:
        if node not in graph.nodes:
            continue
        layout, shape = analysis.layouts[node], analysis.shape(node)
        local = [analysis.global_value(size) for size in shape]
        local[layout.split] //= ctx.shard.world
        method = "expand" if node.target in ("expand", "expand_as", "broadcast_to") else "reshape"
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "broadcast_to":
            method = "expand"
        node.op, node.target = "call_method", method
        node.args, node.kwargs = with_sizes(graph, (node.args[0], *local)), {}
