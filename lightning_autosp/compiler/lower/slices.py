"""Slices, narrows and right pads along the sequence, taken of the global sequence.

The causal shift pairs logit t with target t + 1, so the target of a rank's last position is the next
rank's first token. Before (rank r, global length S)::

    labels [B, S_r] -> labels[:, 1:] -> [B, S_r - 1]          # loses the boundary target

After, every rank reads the window of the source that its output positions take (Note [Windows of the
sequence] in ``ops.py``; rank r owns positions [o(r), o(r + 1)) of the output)::

    labels [B, S_r] -> sequence_window(labels, [o(r) + 1, o(r + 1) + 1)) -> [B, S_r]
                    = cat(labels[:, 1:], next rank's labels[:, :1])

and on the last rank ``labels[:, 1:]`` (it owns positions up to S - 1). The window is one all-to-all in
which a rank sends its first token to the rank before it; a slice whose every window lies within its own
rank's shard is a narrow, with no collective on any rank. Likewise ``logits[:, :-1]`` drops a
position on the last rank only, and a right pad (HF's ``pad(labels, (0, 1), value=-100)``) pads the last
rank only. Bounds may be sequence lengths (``x[:, : T - 1]``): they are read at the global length.
Under a zigzag layout an element comes from this rank or, at a range's end, from the rank holding the
next range (``ops.fetch_rows``).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, index_items, meta_value, op_name
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.runtime import ops
from lightning_autosp.data import SequenceShard


def slices_pass(
    gm: fx.GraphModule, analysis: Analysis, ctx: SPContext, traced: dict[fx.Node, tuple], report: list[str]
) -> None:
    """``traced``: every node's arguments as traced (earlier rewrites replaced some, e.g. HF's pad before
    its shift); sizes and layouts are read off those."""
    graph = gm.graph
    jobs = []
    for node in analysis.plan.slices:
        args, kwargs = traced[node]
        source = args[0]
        dims = [d for d in analysis.layout(source).dims if _touches(node, args, kwargs, d)]
        if node in graph.nodes and dims:
            in_len = analysis.global_value(analysis.shape(source)[dims[0]])
            bounds = (
                None if op_name(node) == "pad" else _bounds(node, args, kwargs, dims[0], in_len, analysis)
            )
            jobs.append((node, dims[0], in_len, bounds, meta_value(source).dim()))
    for node, dim, in_len, bounds, rank in jobs:
        with graph.inserting_before(node):
            if bounds is None:
                replacement = _pad(graph, analysis, node, dim, in_len, rank, ctx)
            else:
                start, stop = bounds
                replacement = _slice(graph, node, dim, in_len, rank, start, max(0, stop - start), ctx)
        positions = symbols.concrete(in_len) if isinstance(in_len, (int, torch.SymInt)) else in_len
        report.append(f"{node.name}: {op_name(node)} of the global sequence ({positions} positions traced)")
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)


def _touches(node: fx.Node, args: tuple, kwargs: dict, dim: int) -> bool:
    """Whether ``node`` (getitem, narrow, pad) cuts or pads ``dim``."""
    name = op_name(node)
    rank = meta_value(args[0]).dim()
    if name == "pad":
        pads = list(args[1] if len(args) > 1 else kwargs["pad"])
        padded = rank - 1 - dim
        return padded < len(pads) // 2 and tuple(pads[2 * padded : 2 * padded + 2]) != (0, 0)
    if name in ("narrow", "slice"):
        return (args[1] if len(args) > 1 else kwargs["dim"]) % rank == dim
    return _index_item(args[1], rank, dim) not in (None, slice(None))


def _index_item(index: object, rank: int, dim: int) -> object:
    items = index_items(index, rank)
    in_dim = 0
    for item in items:
        if item is None:
            continue
        if in_dim == dim:
            return item
        in_dim += 1
    return None


def _bounds(
    node: fx.Node, args: tuple, kwargs: dict, dim: int, in_len: int, analysis: Analysis
) -> tuple[int, int]:
    """[start, stop) of the slice of the global sequence (bounds read at the global length)."""

    def number(value: object) -> int | None:
        return None if value is None else analysis.global_value(analysis.size_expr(value))

    if op_name(node) == "narrow":
        start = number(args[2] if len(args) > 2 else kwargs["start"])
        length = number(args[3] if len(args) > 3 else kwargs["length"])
        start = start % in_len if start < 0 else start
        return start, start + length
    if op_name(node) == "slice":  # aten's (x, dim, start, end, step): step 1, the rule saw to it
        start = number(args[2] if len(args) > 2 else kwargs.get("start"))
        end = number(args[3] if len(args) > 3 else kwargs.get("end"))
        return _clamped(start, 0, in_len), _clamped(end, in_len, in_len)
    item = _index_item(args[1], meta_value(args[0]).dim(), dim)
    return _clamped(number(item.start), 0, in_len), _clamped(number(item.stop), in_len, in_len)


def _clamped(bound: int | None, default: int, length: int) -> int:
    """A step-1 slice bound as ``slice.indices`` reads it, also for SymInt bounds and lengths (each
    comparison a guard, Note [One graph for every length])."""
    if bound is None:
        return default
    if bound < 0:
        bound = bound + length
        return bound if bound >= 0 else 0
    return bound if bound <= length else length


def _slice(
    graph: fx.Graph, node: fx.Node, dim: int, in_len: int, rank: int, start: int, out_len: int, ctx: SPContext
) -> fx.Node:
    source, shard = node.args[0], ctx.shard
    if not shard.is_contiguous:
        seq_fixed = _slice_by_positions(graph, source, dim, in_len, start, out_len, ctx)
    else:
        # every rank's window of the source: [lo + start, hi + start) for the output positions [lo, hi)
        windows = [(lo + start, hi + start) for lo, hi in shard.owned_ranges(out_len)]
        inputs = shard.owned_ranges(in_len)
        if all(lo == hi or (a <= lo and hi <= b) for (lo, hi), (a, b) in zip(windows, inputs)):
            lo, hi = windows[shard.rank]  # every window within its own shard: no collective on any rank
            local_start = lo - inputs[shard.rank][0] if lo < hi else 0
            seq_fixed = call(graph, torch.narrow, (source, dim, local_start, hi - lo))
        else:  # a window reaches into the next ranks' shards: Note [Windows of the sequence]
            seq_fixed = call(graph, ops.sequence_window, (source, dim, *ctx.window_args(windows, in_len)))
    if op_name(node) != "getitem":
        return seq_fixed
    rest = _replace_item(node.args[1], rank, dim)
    if all(item == slice(None) or item is Ellipsis for item in rest):
        return seq_fixed
    return call(graph, operator.getitem, (seq_fixed, rest))


class PositionFetch(NamedTuple):
    """How one rank builds its part of a slice of the sequence under any layout (``ops.fetch_rows``)."""

    sends: list[list[int]]  # this rank's rows (local indices) each rank takes from it
    receives: list[int]  # how many rows each rank sends to this one
    take: list[int]  # per output position, its index in cat([own rows, received from rank 0, 1, ...])
    # every rank's part is one run of its own rows: a narrow, with no collective on any rank (decided from
    # every rank's part, so that no rank meets the collective alone)
    narrow: bool


def fetch_plan(shard: SequenceShard, in_len: int, start: int, out_len: int) -> PositionFetch:
    """This rank's ``PositionFetch`` for ``x[start : start + out_len]`` of a sequence-derived ``x`` of
    ``in_len`` positions: rank r owns the output positions ``shard.positions(out_len, r)``."""
    world, me = shard.world, shard.rank
    owner = {p: (r, i) for r in range(world) for i, p in enumerate(shard.positions(in_len, r))}
    needs = [[owner[p + start] for p in shard.positions(out_len, r)] for r in range(world)]
    taken: list[list[set[int]]] = [[set() for _ in range(world)] for _ in range(world)]
    for r, need in enumerate(needs):
        for o, i in need:
            if o != r:
                taken[o][r].add(i)
    rows = [[sorted(part) for part in parts] for parts in taken]  # rank q's rows rank r takes, as they travel
    receives = [len(rows[q][me]) for q in range(world)]
    first = [len(shard.positions(in_len)) + sum(receives[:q]) for q in range(world)]
    arrived = {(q, i): first[q] + k for q in range(world) for k, i in enumerate(rows[q][me])}
    take = [i if q == me else arrived[q, i] for q, i in needs[me]]

    def one_run(r: int) -> bool:
        indices = [i for _, i in needs[r]]
        own = all(o == r for o, _ in needs[r])
        return own and (not indices or indices == list(range(indices[0], indices[0] + len(indices))))

    return PositionFetch(rows[me], receives, take, all(one_run(r) for r in range(world)))


def _slice_by_positions(
    graph: fx.Graph, source: fx.Node, dim: int, in_len: int, start: int, out_len: int, ctx: SPContext
) -> fx.Node:
    """Under a layout of several ranges per rank (zigzag): each element from this rank's shard or, at a
    range's end, from the rank holding the next range."""
    fetch = fetch_plan(ctx.shard, in_len, start, out_len)
    if fetch.narrow:
        first = fetch.take[0] if fetch.take else 0
        return call(graph, torch.narrow, (source, dim, first, len(fetch.take)))
    args = (source, dim, fetch.sends, fetch.receives, fetch.take, ctx.group_name)
    return call(graph, ops.fetch_rows, args)


def _replace_item(index: object, rank: int, dim: int) -> tuple:
    items = index_items(index, rank)
    in_dim = 0
    for position, item in enumerate(items):
        if item is None:
            continue
        if in_dim == dim:
            items[position] = slice(None)
        in_dim += 1
    return tuple(items)


def _pad(
    graph: fx.Graph, analysis: Analysis, node: fx.Node, dim: int, in_len: int, rank: int, ctx: SPContext
) -> fx.Node:
    """A right pad of the global sequence: the owner of the last positions pads (an amount computed from
    the length, to a multiple of a chunk, at the global length)."""
    source = node.args[0]
    pads = list(node.args[1] if len(node.args) > 1 else node.kwargs["pad"])
    padded = rank - 1 - dim
    right = analysis.global_value(analysis.size_expr(pads[2 * padded + 1]))
    out_len = in_len + right
    local_in, keep, fill = _pad_counts(ctx.shard, in_len, out_len)
    narrowed = source if keep == local_in else call(graph, torch.narrow, (source, dim, 0, keep))
    pads[2 * padded : 2 * padded + 2] = [0, max(0, fill)]
    if not any(pads):
        return narrowed
    return call(graph, F.pad, (narrowed, tuple(pads), *node.args[2:]), dict(node.kwargs))


def _pad_counts(shard: SequenceShard, in_len: int, out_len: int) -> tuple[int, int, int]:
    """(this rank's input length, how many of its input elements stay, how many pad elements follow)."""
    if shard.is_contiguous:
        lo, hi = shard.owned_range(out_len)
        lo_in, hi_in = shard.owned_range(in_len)
        return hi_in - lo_in, min(hi, in_len) - lo, hi - max(lo, in_len)
    # Every rank's positions ascend, so the pad positions (>= in_len) are a suffix of its shard.
    owned = shard.positions(out_len)
    keep = sum(p < in_len for p in owned)
    return len(shard.positions(in_len)), keep, len(owned) - keep


def selections_pass(
    gm: fx.GraphModule, analysis: Analysis, ctx: SPContext, traced: dict[fx.Node, tuple], report: list[str]
) -> None:
    """Positions picked along the sequence (``x[:, -1]``, ``x.select(1, i)``, ``x[arange(B), last]``)
    become a partial sum: the rank holding a position gives it, the others zeros that keep the graph
    connected, so every rank runs the all-reduce and its backward (Note [Redistribution])."""
    graph = gm.graph
    for node in analysis.plan.selections:
        if node not in graph.nodes:
            continue
        args, _ = traced[node]
        (dim,) = analysis.layout(args[0]).dims
        length = analysis.global_value(analysis.shape(args[0])[dim])
        with graph.inserting_before(node):
            if op_name(node) == "select":
                replacement = _select_owned(graph, analysis, ctx, node.args[0], dim, args[2], length)
            else:  # the index as it is now: token data in it was recomputed whole (recompute.py)
                replacement = _index_owned(graph, analysis, ctx, node, node.args[1], dim, length)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        report.append(f"{node.name}: positions of the sequence picked where they live (a partial sum)")


def _select_owned(
    graph: fx.Graph, analysis: Analysis, ctx: SPContext, source: fx.Node, dim: int, index: object, length: int
) -> fx.Node:
    position = analysis.global_value(analysis.size_expr(index)) % length
    local, owner = _local_index(ctx, length, position)
    return _given_by_owner(graph, call(graph, torch.select, (source, dim, local)), owner)


def _local_index(ctx: SPContext, length: int, position: int) -> tuple[int, bool]:
    """(where global ``position`` of a tensor of ``length`` positions sits on this rank, whether it does);
    by bounds for a contiguous shard, whose sizes may be SymInts (a guard on which rank holds it)."""
    if ctx.shard.is_contiguous:
        lo, hi = ctx.shard.owned_range(length)
        owner = bool(lo <= position) and bool(position < hi)
        return (position - lo if owner else 0), owner
    owned = ctx.owned(length)
    return (owned.index(position) if position in owned else 0), position in owned


def _given_by_owner(graph: fx.Graph, picked: fx.Node, owner: bool) -> fx.Node:
    """The owner's pick; elsewhere zeros still computed from it, so the graph (and the all-reduce's
    backward, a collective every rank must run) stays connected."""
    return picked if owner else call(graph, torch.where, (call(graph, torch.tensor, (False,)), picked, 0.0))


def _index_owned(
    graph: fx.Graph, analysis: Analysis, ctx: SPContext, node: fx.Node, index: object, dim: int, length: int
) -> fx.Node:
    source = node.args[0]
    items = index_items(index, meta_value(source).dim())
    in_dim, position = 0, None
    for at, item in enumerate(items):
        if item is None:
            continue
        if in_dim == dim:
            position = at
        in_dim += 1
    item = items[position]
    if not (isinstance(item, fx.Node) and isinstance(meta_value(item), torch.Tensor)):  # an int or a length
        return _select_in_items(graph, analysis, ctx, source, items, position, dim, length)
    lo, hi = ctx.shard.owned_range(length)
    wrapped = call(graph, torch.remainder, (item, length))  # negative positions count from the end
    valid = call(
        graph,
        operator.and_,
        (call(graph, operator.ge, (wrapped, lo)), call(graph, operator.lt, (wrapped, hi))),
    )
    local = call(graph, torch.where, (valid, call(graph, operator.sub, (wrapped, lo)), 0))
    items[position] = local
    picked = call(graph, operator.getitem, (source, tuple(items)))
    tensors = [i for i in items if isinstance(i, fx.Node)]
    index_shape = torch.broadcast_shapes(*[tuple(meta_value(t).shape) for t in tensors])
    adjacent = [at for at, i in enumerate(items) if isinstance(i, fx.Node)]
    first = adjacent[0] if adjacent == list(range(adjacent[0], adjacent[-1] + 1)) else 0
    leading = sum(1 for i in items[:first] if i is not None) if first else 0
    out_rank = meta_value(node).dim()
    shape = [1] * leading + [1] * (len(index_shape) - meta_value(item).dim()) + list(meta_value(item).shape)
    shape += [1] * (out_rank - len(shape))
    mask = call(graph, torch.reshape, (valid, shape))
    return call(graph, torch.where, (mask, picked, 0.0))


def _select_in_items(
    graph: fx.Graph,
    analysis: Analysis,
    ctx: SPContext,
    source: fx.Node,
    items: list,
    position: int,
    dim: int,
    length: int,
) -> fx.Node:
    """``x[:, -1, :k]``: the int at the sequence dim picked where it lives, the other items as written."""
    wanted = analysis.global_value(analysis.size_expr(items[position])) % length
    items = list(items)
    items[position], owner = _local_index(ctx, length, wanted)
    picked = call(graph, operator.getitem, (source, tuple(items)))
    return _given_by_owner(graph, picked, owner)
