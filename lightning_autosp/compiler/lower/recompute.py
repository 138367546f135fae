"""Token data computed for the whole sequence: the gathered per-token inputs, the graph's own ops.

Note [Recomputing token data]
    Token data (integer and other gradient-free values computed from the batch's per-token inputs,
    sizes, constants and buffers: labels, positions, document ids, masks) is small next to the
    activations: [B, S] integers against [B, S, h] floats per layer. When an op mixes it along the
    sequence (a ``cumsum`` of the attention mask into positions, ``roll`` of the labels, the ``diff`` and
    comparisons that find packed documents), the pass computes that value for the whole sequence and
    keeps this rank's part, instead of refusing:

        labels [B, S_r] -> roll(-1, 1) -> ...
      becomes
        labels [B, S_r] -> gather_sequence -> [B, S] -> roll(-1, 1) -> [B, S] -> narrow (this rank) -> ...

    The copy re-runs the graph's own nodes, as traced (``GlobalCopier`` reads them as they were before
    any rewrite), with every sequence length in them set to its global value and every sharded input
    gathered. Because the graph was traced with symbolic lengths (Note [Symbolic sequence lengths]),
    that copy is exactly the single-device computation. Attention masks are the same copy, kept whole
    (``masks.py``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, example_value, set_fake_value, with_sizes
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.layout import Layout
from lightning_autosp.compiler.runtime import ops  # noqa: F401  (registers torch.ops.autosp)

_GATHER = torch.ops.autosp.gather_sequence.default


class GlobalCopier:
    """Copies of a graph's nodes computed for the whole sequence (Note [Recomputing token data]).

    Construct it before any rewrite: it snapshots every node's arguments, so later rewrites of the
    local graph do not leak into the copies.
    """

    def __init__(self, gm: fx.GraphModule, analysis: Analysis, ctx: SPContext) -> None:
        self.graph, self.analysis, self.ctx = gm.graph, analysis, ctx
        self.pristine = {node: (node.args, node.kwargs) for node in gm.graph.nodes}
        self.order = {node: index for index, node in enumerate(gm.graph.nodes)}
        self.copies: dict[fx.Node, object] = {}
        self._last_copy: fx.Node | None = None

    def copy(self, node: fx.Node) -> fx.Node:
        """The whole-sequence value of ``node``. Copies depend on graph inputs only, so they all go right
        after the inputs (and the gathers of sharded ones), in graph order: every later use sees them."""
        for current in self._chain(node):
            if current not in self.copies:
                self.copies[current] = self._copy_one(current)
        return self.copies[node]

    def localize(self, node: fx.Node, layout: Layout, before: fx.Node) -> fx.Node:
        """This rank's part of ``node``'s whole-sequence value, along every sequence dim of ``layout``."""
        whole = self.copy(node)
        shape = self.analysis.shape(node)
        with self.graph.inserting_before(before):
            for dim in layout.dims:
                whole = take_owned(self.graph, whole, dim, self.ctx, self.analysis.global_value(shape[dim]))
        return whole

    # ---------------------------------------------------------------------------------------------

    def _chain(self, node: fx.Node) -> list[fx.Node]:
        """``node`` and its ancestors (as traced), in graph order."""
        seen, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            args, kwargs = self.pristine.get(current, (current.args, current.kwargs))
            stack.extend(_nodes_in((args, kwargs)))
        return sorted(seen, key=lambda n: self.order.get(n, len(self.order)))

    def _copy_one(self, node: fx.Node) -> object:
        analysis = self.analysis
        if node in analysis.sizes:  # a sequence length: its global value
            expr = analysis.sizes[node]
            if isinstance(expr, tuple):
                return tuple(analysis.global_value(e) for e in expr)
            return analysis.global_value(expr)
        if node.op == "placeholder":
            return self._gathered(node) if analysis.layout(node).is_shard else node
        if node.op == "get_attr":
            return node
        args, kwargs = self.pristine[node]
        mapped = with_sizes(self.graph, fx.node.map_arg((args, kwargs), lambda n: self.copies.get(n, n)))
        with self.graph.inserting_after(self._insertion_point(_nodes_in(mapped))):
            copy = self.graph.create_node(node.op, node.target, *mapped, name=f"{node.name}_global")
        self._last_copy = copy
        copy.meta = {
            key: value for key, value in node.meta.items() if key in ("stack_trace", "nn_module_stack")
        }
        set_fake_value(copy)
        return copy

    def _insertion_point(self, inputs: list[fx.Node]) -> fx.Node:
        """The latest of a copy's inputs and the copy made before it: copies depend on graph inputs (and
        their gathers) only, so they all sit near the top of the graph, before any use."""
        candidates = {*inputs, *([self._last_copy] if self._last_copy is not None else [])}
        last = None
        for node in self.graph.nodes:  # never before the last input: a copy of sizes alone reads symbols only
            if node.op == "placeholder" or node in candidates:
                last = node
        return last

    def _gathered(self, token: fx.Node) -> fx.Node:
        """``gather_sequence(token)`` right after the graph inputs; one per input and graph."""
        (dim,) = self.analysis.layout(token).dims
        for user in token.users:
            if user.target is _GATHER and user.args[1] == dim:
                return self._in_sequence_order(user, dim)
        # After the sizes computed from the length symbols as well: the gather's shard lengths may be some.
        first = next(n for n in self.graph.nodes if n.op != "placeholder" and "autosp_size" not in n.meta)
        with self.graph.inserting_before(first):
            gathered = call(
                self.graph, _GATHER, (token, dim, list(self.ctx.shard.seq_lens), self.ctx.group_name)
            )
        return self._in_sequence_order(gathered, dim)

    def _in_sequence_order(self, gathered: fx.Node, dim: int) -> fx.Node:
        """Shards concatenated in rank order, put in sequence order (they already are, but for zigzag)."""
        shard = self.ctx.shard
        if shard.is_contiguous:
            return gathered
        for user in gathered.users:
            if user.target is torch.index_select:
                return user
        with self.graph.inserting_after(gathered):
            index = call(
                self.graph,
                torch.tensor,
                (shard.sequence_order(),),
                {"device": example_value(gathered).device},
            )
        with self.graph.inserting_after(index):
            return call(self.graph, torch.index_select, (gathered, dim, index))


def take_owned(graph: fx.Graph, value: fx.Node, dim: int, ctx: SPContext, length: int) -> fx.Node:
    """This rank's positions of ``value`` (a sequence-derived tensor of ``length`` positions, whole along
    ``dim``); a narrow for a contiguous shard, whose bounds may be SymInts."""
    if ctx.shard.is_contiguous:
        start, stop = ctx.shard.owned_range(length)
        return call(graph, torch.narrow, (value, dim, start, stop - start))
    return take_positions(graph, value, dim, ctx.owned(length))


def take_positions(graph: fx.Graph, value: fx.Node, dim: int, positions: list[int]) -> fx.Node:
    """``value`` (whole along ``dim``) at ``positions``: a narrow when they are one run, else an index."""
    start = positions[0] if positions else 0
    if positions == list(range(start, start + len(positions))):
        return call(graph, torch.narrow, (value, dim, start, len(positions)))
    index = call(graph, torch.tensor, (positions,), {"device": example_value(value).device})
    return call(graph, torch.index_select, (value, dim, index))


def _nodes_in(value: object) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def recompute_pass(copier: GlobalCopier) -> list[str]:
    """Every token-data value the plan lists as mixed along the sequence becomes this rank's part of its
    whole-sequence value (Note [Recomputing token data]). Returns what was rewritten, for the report."""
    analysis, done = copier.analysis, []
    for node in analysis.plan.recompute:
        if not node.users:
            continue  # only a mask used it, and masks are rebuilt whole (masks.py)
        layouts = analysis.layouts.get(node)
        if isinstance(layouts, tuple):  # sort, topk, cummax: each element read with getitem
            parts = [
                (user, layouts[user.args[1]]) for user in list(node.users) if user.target is operator.getitem
            ]
        else:
            parts = [(node, layouts)]
        for part, layout in parts:
            first_use = min(part.users, key=lambda n: copier.order.get(n, len(copier.order)), default=None)
            if first_use is None:
                continue
            local = copier.localize(part, layout, first_use) if layout.dims else copier.copy(part)
            part.replace_all_uses_with(local, delete_user_cb=lambda user, local=local: user is not local)
        done.append(node.name)
    return done
