"""Attention masks for the whole sequence: after the all-to-all, attention relates all S positions.

Note [Masks over the whole sequence]
    A mask is computed, like any token data, from sizes, positions, per-token inputs (document ids,
    ``position_ids`` that restart at each packed document, padding) and constants, all traced with
    symbolic lengths. The pass rebuilds it for the whole sequence with the graph's own ops
    (Note [Recomputing token data] in ``recompute.py``), with one saving first: a mask computed from
    sizes alone is evaluated at a probe length, and if it is exactly causal it is dropped for
    ``is_causal=True``, so no rank holds an S x S tensor (HF builds such a mask under torch.compile).
    A mask with a heads dim keeps this rank's heads. A mask computed from activations or parameters
    is refused by the analysis.

    Masks that cross from one graph to the next (DDP's buckets put HF's mask and the attentions that
    use it in different graphs) are decided where they leave: tagged ``CAUSAL`` (attention in the next
    graph drops them) or rebuilt whole and tagged ``global``.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, example_value, meta_value
from lightning_autosp.compiler.lower.recompute import GlobalCopier, _nodes_in
from lightning_autosp.compiler.prove.layout import CAUSAL, REPLICATE, Tag, global_

log = logging.getLogger(__name__)

_MAX_PROBE_ENTRIES = 1 << 24


def attention_mask(
    copier: GlobalCopier, attention: fx.Node, mask: object, heads: int, is_causal: bool, report: list[str]
) -> tuple[fx.Node | None, bool]:
    """(the mask attention uses after the all-to-all, is_causal) for one attention call."""
    if not isinstance(mask, fx.Node):
        return mask, is_causal
    analysis, ctx = copier.analysis, copier.ctx
    layout = analysis.layout(mask)
    if layout == CAUSAL:
        report.append(f"{attention.name}: causal mask from the previous graph -> is_causal=True")
        return None, True
    if layout == REPLICATE or layout.kind == "global":
        return _this_ranks_heads(copier.graph, mask, ctx, heads, attention), is_causal
    # A mask from per-token inputs under the zigzag layout was refused (Note [Refusals before rewriting]).
    if not _sharded_inputs(copier, mask) and is_causal_mask(copier, mask):
        report.append(f"{attention.name}: causal mask -> is_causal=True")
        return None, True
    whole = copier.copy(mask)
    report.append(f"{attention.name}: mask rebuilt for the whole sequence ({mask.name})")
    return _this_ranks_heads(copier.graph, whole, ctx, heads, attention, like=mask), is_causal


def _this_ranks_heads(
    graph: fx.Graph, mask: fx.Node, ctx: SPContext, heads: int, before: fx.Node, like: fx.Node | None = None
) -> fx.Node:
    """A mask with a heads dim ([B, H, S, S], ALiBi's [H, S, S]: the dim before the last two) keeps the
    heads this rank attends for after the all-to-all."""
    value = example_value(like if like is not None else mask)
    if value is None or value.dim() < 3 or value.shape[-3] != heads or heads == 1:
        return mask
    per_rank = heads // ctx.shard.ulysses_degree
    start = ctx.shard.ulysses_rank * per_rank
    with graph.inserting_before(before):
        return call(graph, torch.narrow, (mask, value.dim() - 3, start, per_rank))


def _sharded_inputs(copier: GlobalCopier, node: fx.Node) -> list[fx.Node]:
    return [n for n in copier._chain(node) if n.op == "placeholder" and copier.analysis.layout(n).is_shard]


def is_causal_mask(copier: GlobalCopier, mask: fx.Node) -> bool:
    """Whether ``mask``, computed from sizes alone, is the plain causal mask.

    Its producers are evaluated at a probe length n: S itself when S x S is small, else a length past
    every integer constant in them, so that a sliding window or an offset shows up as a difference
    from ``tril``. Boolean masks must equal ``tril``; additive ones must be 0 on it and at most half the
    dtype's minimum off it (exp() of that is exactly 0 against any real score).
    """
    analysis = copier.analysis
    chain = copier._chain(mask)
    if any(
        n.op == "placeholder" and n not in analysis.sizes and analysis.layout(n) != REPLICATE for n in chain
    ):
        return False
    constants = [abs(c) for n in chain for c in _ints(copier.pristine.get(n, (n.args, n.kwargs)))]
    probe = max(16, 2 * max(constants, default=0) + 2)
    if not analysis.every_length:  # a graph for one length: a window longer than it is never reached
        total = analysis.global_value(next(iter(analysis.lengths))) if analysis.lengths else 0
        probe = min(max(total, 2), probe)
    if probe * probe > _MAX_PROBE_ENTRIES:
        log.info("mask %s: not probed for causality (probe length %d too long); kept", mask, probe)
        return False
    value = _evaluate(copier, chain, mask, probe)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (probe, probe):
        return False
    causal = torch.ones(probe, probe, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == causal).all())
    if not value.is_floating_point():
        return False
    blocked = value <= torch.finfo(value.dtype).min / 2
    return bool(((value == 0) == causal).all() and (blocked != causal).all())


def _evaluate(copier: GlobalCopier, chain: list[fx.Node], mask: fx.Node, probe: int) -> object:
    """Run ``mask``'s producers with every sequence length at ``probe`` (one length symbol only)."""
    analysis = copier.analysis
    if len(analysis.lengths) != 1:
        return None
    (symbol,) = analysis.lengths
    graph, copies = fx.Graph(), {}
    for node in chain:
        if node in analysis.sizes:
            expr = analysis.sizes[node]
            exprs = expr if isinstance(expr, tuple) else (expr,)
            values = tuple(int(e.subs({symbol: probe})) for e in exprs)
            copies[node] = values if isinstance(expr, tuple) else values[0]
        elif node.op == "placeholder":
            copies[node] = graph.placeholder(node.name)
        else:
            args, kwargs = copier.pristine.get(node, (node.args, node.kwargs))
            mapped = fx.node.map_arg((args, kwargs), lambda n: copies.get(n, n))
            copies[node] = graph.create_node(node.op, node.target, *mapped)
    graph.output(copies[mask])
    inputs = [n for n in chain if n.op == "placeholder" and n not in analysis.sizes]
    try:
        real = [_real(meta_value(n)) for n in inputs]
        with unset_fake_temporarily(), torch.no_grad():
            return fx.GraphModule(copier.graph.owning_module, graph)(*real)
    except Exception as error:  # a producer that needs its traced context: keep the mask
        log.info("mask %s: could not be evaluated at length %d (%s); kept", mask, probe, error)
        return None


def _real(value: object) -> object:
    if isinstance(value, torch.Tensor):
        raise TypeError("a mask from tensor inputs is not probed")
    return value


def _ints(value: object) -> list[int]:
    found: list[int] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if type(v) is int else None)  # bools are not sizes
    return found


def hand_on_masks(
    copier: GlobalCopier, output: fx.Node, output_tags: list[Tag | None], report: list[str]
) -> None:
    """Masks leaving this graph for the next one (Note [Masks over the whole sequence])."""
    analysis = copier.analysis
    values = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    replaced = {}
    for index, value in enumerate(values):
        if not isinstance(value, fx.Node) or index >= len(output_tags):
            continue
        layout = analysis.layout(value)
        if not (layout.is_shard and layout.is_pairwise) or value not in analysis.token_data:
            continue
        if not _sharded_inputs(copier, value) and is_causal_mask(copier, value):
            # The next graph drops it for is_causal=True: an empty stand-in of the same rank is enough.
            fake = meta_value(value)
            shape = [int(size) for size in fake.shape[:-2]] + [
                0,
                analysis.global_value(analysis.shape(value)[-1]),
            ]
            with copier.graph.inserting_before(output):
                replaced[value] = call(
                    copier.graph, torch.empty, (shape,), {"dtype": fake.dtype, "device": fake.device}
                )
            output_tags[index] = Tag(CAUSAL)
            report.append(f"{value.name}: causal, handed on as a tag")
            continue
        replaced[value] = copier.copy(value)
        shape = analysis.shape(value)
        output_tags[index] = Tag(
            global_(*layout.dims), tuple(analysis.global_value(shape[d]) for d in layout.dims)
        )
        report.append(f"{value.name}: handed on rebuilt for the whole sequence")
    if replaced:
        output.args = fx.node.map_arg(output.args, lambda n: replaced.get(n, n))


__all__ = ["attention_mask", "hand_on_masks", "is_causal_mask", "_nodes_in"]
