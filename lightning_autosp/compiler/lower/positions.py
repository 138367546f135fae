"""Where this rank's tokens are: positions, position tables and sequence lengths.

- ``arange(T)`` over a sequence length gives this rank's global positions (``arange(o_r, o_r + S_r)``;
  the concatenated ranges of a zigzag shard, Note [Ring layouts] in ``data.py``); ``arange(c, T + c)``
  gives them shifted by the constant ``c``.
- ``table[:T]`` of a replicated table (learned positions ``pos_emb[:, :t]``, a rope cache ``cos[:T]``,
  ``freqs_cis[:seqlen]``) gives the table's rows at those positions.
- A sequence length used as a value (``loss / T``, ``torch.full(..., T)``) is the global length: the
  single-device program computed with it. Used as a shape, it is this rank's count of positions of a
  tensor of that global length (``view(B * (T - 1))`` after a shift: ``B * owned(S - 1)``).
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, index_items, meta_value, set_fake_value, with_sizes
from lightning_autosp.compiler.lower.recompute import take_owned
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.preconditions import shape_part


def positions_pass(gm: fx.GraphModule, analysis: Analysis, ctx: SPContext, report: list[str]) -> None:
    graph = gm.graph
    for node in analysis.plan.positions:
        if node not in graph.nodes or not node.users:
            continue
        end = node.args[1] if len(node.args) > 1 else node.args[0] if node.args else node.kwargs["end"]
        first = int(analysis.size_expr(node.args[0] if len(node.args) > 1 else node.kwargs.get("start", 0)))
        length = analysis.global_value(analysis.size_expr(end) - first)
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("start", "end", "step")}
        runs = [ctx.shard.owned_range(length)] if ctx.shard.is_contiguous else _runs(ctx.owned(length))
        runs = [(first + start, first + stop) for start, stop in runs]  # arange(c, T + c): shifted by c
        if len(runs) == 1:
            start, stop = runs[0]
            node.args, node.kwargs = with_sizes(graph, (start, stop)), kwargs
            set_fake_value(node)
            report.append(f"{node.name}: {_positions(first, length)} -> [{_at(start)}, {_at(stop)})")
            continue
        with graph.inserting_before(node):
            pieces = [call(graph, torch.arange, run, kwargs) for run in runs]
            positions = call(graph, torch.cat, (pieces,))
        node.replace_all_uses_with(positions)
        graph.erase_node(node)
        pieces_text = ", ".join(f"[{_at(start)}, {_at(stop)})" for start, stop in runs)
        report.append(f"{node.name}: {_positions(first, length)} -> {pieces_text}")
    for node in analysis.plan.tables:
        if node not in graph.nodes or not node.users:
            continue
        out_dim = analysis.layout(node).dims[0]
        length = analysis.global_value(analysis.shape(node)[out_dim])
        table, dim, rest = node.args[0], *_table_dim(node)
        with graph.inserting_before(node):
            rows = take_owned(graph, table, dim, ctx, length)
            if rest is not None:
                rows = call(graph, operator.getitem, (rows, rest))
        node.replace_all_uses_with(rows)
        graph.erase_node(node)
        report.append(f"{node.name}: {table.name}[:{_at(length)}] -> its rows at this rank's positions")


def _at(size: object) -> int:
    """A size as a number of tokens, at the length traced (explain() speaks in lengths, not symbols)."""
    return symbols.concrete(size)


def _positions(first: int, length: object) -> str:
    """What a position ``arange`` computes on one device, in tokens at the traced length."""
    return f"positions {first} to {first + _at(length) - 1} of the sequence, this rank's"


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs or [(0, 0)]


def _table_dim(node: fx.Node) -> tuple[int, tuple | None]:
    """(the table dim ``node`` slices by the length, the rest of its index with that dim taken whole)."""
    if node.target is not operator.getitem:  # narrow(table, dim, 0, T)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        return dim % meta_value(node.args[0]).dim(), None
    items = index_items(node.args[1], meta_value(node.args[0]).dim())
    dim = 0
    for position, item in enumerate(items):
        if item is None:
            continue
        if isinstance(item, slice) and isinstance(item.stop, fx.Node):
            rest = tuple(slice(None) if i == position else item for i, item in enumerate(items))
            plain = all(item == slice(None) for item in rest)
            return dim, None if plain else rest
        dim += 1
    raise AssertionError(f"{node.name}: no slice by the length")


def lengths_pass(gm: fx.GraphModule, analysis: Analysis, ctx: SPContext) -> None:
    """Sequence lengths in the arguments of the (local) graph's ops become plain numbers: global as
    values, this rank's counts as shapes (see the module docstring)."""
    graph = gm.graph
    values = {(user, size) for user, size in analysis.plan.value_sizes}
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or node in analysis.sizes:
            continue  # arithmetic on lengths: its users get the number it computes, and it goes dead
        if "autosp_size" in node.meta:
            continue  # a size the pass wrote in the shard symbols (symbols.size_node): already this rank's
        global_shapes = node in analysis.plan.global_shapes

        def replace(arg: object, node: fx.Node = node, global_shapes: bool = global_shapes) -> object:
            if not isinstance(arg, fx.Node) or arg not in analysis.sizes:
                return arg
            expr = analysis.sizes[arg]
            if isinstance(expr, tuple):
                return tuple(_number(analysis, ctx, e, (node, arg) in values or global_shapes) for e in expr)
            return _number(analysis, ctx, expr, (node, arg) in values or global_shapes)

        node.args = with_sizes(graph, fx.node.map_aggregate(node.args, replace))
        node.kwargs = with_sizes(graph, fx.node.map_aggregate(node.kwargs, replace))


def _number(analysis: Analysis, ctx: SPContext, expr: sympy.Expr, as_value: bool) -> int | torch.SymInt:
    if as_value:
        return analysis.global_value(expr)
    symbol, scale, rest = shape_part(analysis, expr)
    # a shape no rank can tell its part of was refused (Note [Refusals before rewriting])
    assert scale is not None, f"{expr}: the analysis let through a shape that is not a multiple of a length"
    if scale == 0:
        return int(rest)
    return int(scale) * ctx.owned_count(analysis.global_value(symbol) + int(rest // scale))
