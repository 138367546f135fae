"""Reductions over the sequence: partial sums made whole, means over the global count, losses.

Note [Loss over sequence shards]
    A sum over this rank's tokens is ``PARTIAL`` (Note [Sequence layouts]): one all-reduce makes it the
    single-device sum where a consumer needs the whole value (a division, the graph's output). A mean
    over the sequence is a partial sum over the global count. A mean cross-entropy or NLL over valid
    tokens becomes::

        total, count = all_reduce_sum(stack([cross_entropy(..., reduction="sum"),
                                             (targets != ignore_index).sum()]))   # class weights: sum of w[t]
        loss = total / count

    so every rank returns the single-device loss; a shard without valid tokens adds 0, not NaN.
    ``all_reduce_sum``'s backward sums the ranks' gradients: each of the P ranks backpropagates the
    same total, so each rank's partial sum receives P times the gradient, and DDP's mean over all
    dp x sp ranks divides that P back out, leaving the mean over dp groups. Maxima and minima over the
    sequence are all-reduces too (``all_reduce_extremum``).
"""

from __future__ import annotations

import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, example_value, meta_value, op_name, redirect_uses
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.rules.common import normalize_dims
from lightning_autosp.compiler.runtime import ops

_ALL_REDUCE = ops.all_reduce_sum
_EXTREMUM = torch.ops.autosp.all_reduce_extremum.default
_SIGNATURES = {"cross_entropy": inspect.signature(F.cross_entropy), "nll_loss": inspect.signature(F.nll_loss)}


def losses_pass(
    gm: fx.GraphModule, analysis: Analysis, ctx: SPContext, traced: dict[fx.Node, tuple], report: list[str]
) -> None:
    """``traced``: every node's arguments as traced (sizes are read off those, not off rewritten inputs)."""
    graph, group = gm.graph, ctx.group_name
    for node in analysis.plan.losses:
        _mean_over_valid_tokens(graph, node, group)
        report.append(f"{node.name}: mean over the valid tokens of the whole sequence")
    for node in analysis.plan.reductions:
        _mean_over_global_count(graph, node, analysis, traced[node][0][0])
        report.append(f"{node.name}: {op_name(node)} -> sum over the global count (partial)")
    for node in analysis.plan.extrema:
        _extremum(graph, node, group)
        report.append(f"{node.name}: {op_name(node)} over the sequence -> all-reduce")


def _mean_over_valid_tokens(graph: fx.Graph, node: fx.Node, group: str) -> None:
    args = _SIGNATURES[op_name(node)].bind(*node.args, **node.kwargs)
    args.apply_defaults()
    args = dict(args.arguments)
    target, weight, ignore_index = args["target"], args["weight"], args["ignore_index"]
    dtype = example_value(node).dtype
    with graph.inserting_before(node.next):
        if example_value(target).is_floating_point():  # probabilities: the mean is over token positions
            tokens = (
                math.prod(example_value(target).shape)
                // example_value(target).shape[1 if example_value(target).dim() > 1 else 0]
            )
            local_count = call(
                graph, torch.full, ((), tokens), {"dtype": dtype, "device": example_value(node).device}
            )
        else:
            valid = call(graph, operator.ne, (target, ignore_index))
            if weight is None:
                local_count = call(graph, torch.sum, (valid,), {"dtype": dtype})
            else:
                classes = call(graph, torch.where, (valid, target, 0))
                weights = call(graph, torch.index_select, (weight, 0, call(graph, torch.flatten, (classes,))))
                flat_valid = call(graph, torch.flatten, (valid,))
                local_count = call(graph, torch.sum, (call(graph, operator.mul, (weights, flat_valid)),))
        keep = call(graph, torch.stack, ([node, local_count],))
        totals = call(graph, _ALL_REDUCE, (keep, group))
        total = call(graph, operator.getitem, (totals, 0))
        count = call(graph, operator.getitem, (totals, 1))
        loss = call(graph, operator.truediv, (total, count))
    redirect_uses(node, loss, keep=keep)
    node.args = (args["input"], target)
    node.kwargs = {
        k: v for k, v in args.items() if k not in ("input", "target", "size_average", "reduce")
    } | {"reduction": "sum"}


def _mean_over_global_count(graph: fx.Graph, node: fx.Node, analysis: Analysis, source: fx.Node) -> None:
    """mean over dims with sequence dims -> sum / (their global sizes' product); a loss's mean -> "
    "sum / numel."""
    shape = analysis.shape(source)
    name = op_name(node)
    if name in ("mean", "nanmean"):
        dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = normalize_dims(dims_arg, len(shape))
        count = math.prod(analysis.global_value(shape[d]) for d in dims)
        node.target = "sum" if node.op == "call_method" else torch.sum
    else:  # an elementwise loss with reduction="mean" (or "batchmean")
        full = analysis.shape(node)  # its result broadcasts input and target: reduced over all of it
        sizes = [analysis.global_value(e) for e in (analysis.shape(source) or full)]
        batchmean = node.kwargs.get("reduction") == "batchmean"
        count = sizes[0] if batchmean else math.prod(sizes)
        node.kwargs = {**node.kwargs, "reduction": "sum"}
    with graph.inserting_after(node):
        mean = call(graph, operator.truediv, (node, count))
    redirect_uses(node, mean)


def _extremum(graph: fx.Graph, node: fx.Node, group: str) -> None:
    name = op_name(node)
    reduce_op = "max" if name in ("amax", "max", "any") else "min"
    values = node
    if isinstance(meta_value(node), (tuple, list)):  # max(x, dim): (values, indices)
        values = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
        if values is None:
            return
    with graph.inserting_after(values):
        whole = call(graph, _EXTREMUM, (values, reduce_op, group))
    redirect_uses(values, whole)
