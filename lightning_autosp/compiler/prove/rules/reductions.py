"""Rules for ops that read across a dim: norms, softmax, scans, sorts, flips, reductions, losses.

Across any dim but the sequence they propagate. Across the sequence: a sum becomes ``PARTIAL``, a mean a sum
over the global count, a max an all-reduce (``losses.py``); cross-entropy and NLL keep their mean over the
valid tokens of the whole sequence; scans, sorts and flips of token data are recomputed for the whole
sequence, of activations run on the whole sequence for a block of another dim (Note [Redistribution]).
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.fx_utils import bind, op_name
from lightning_autosp.compiler.prove.layout import PARTIAL, REPLICATE, Layout
from lightning_autosp.compiler.prove.plan import Decided, decide, layout_of, relayout
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import (
    ATTENTION_FIX,
    arg,
    materialize_all,
    ndim,
    no_split_fix,
    normalize_dims,
    reduced_positions,
)
from lightning_autosp.compiler.prove.rules.elementwise import pointwise
from lightning_autosp.compiler.prove.rules.split import (
    Operand,
    align,
    choose,
    handles_split,
)


def along_dim(
    a, node: fx.Node, dim: object, what: str, fix: str, *, tuple_out: int = 0, keeps_blocks: bool = False
) -> object:
    """An op that reads across ``dim`` and keeps the shape (softmax, cumsum, sort, flip, roll...).

    Across the sequence of an activation it runs on the whole sequence for a block of another dim
    (Note [Redistribution]); ``keeps_blocks``: along a split dim too (repeat_interleave maps blocks to
    blocks)."""
    materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    rank = ndim(source)
    dims = normalize_dims(dim, rank)
    if layout.kind in ("rows", "inverse") and 0 in dims:
        return a.refuse(node, f"{what} across rows of this rank's tokens ({layout})", dispatch.FIX)
    if layout.is_split and layout.split in dims and not keeps_blocks:
        layout = a.sequence_home(source)
    if set(dims) & set(layout.dims) and layout.kind == "shard" and node not in a.token_data:
        operand = Operand(source, {d: d for d in range(rank)})
        out_dim = choose(a, [operand], [d for d in range(rank) if d not in dims and d not in layout.dims])
        regrouped = align(a, [operand], out_dim, rank) if out_dim is not None else None
        if regrouped is not None:
            layout = regrouped
    out = (layout,) * tuple_out if tuple_out else layout
    if set(dims) & set(layout.dims) and not layout.is_split:
        return a.mixes(node, what, out, no_split_fix(a, source, fix))
    return out


@dispatch.handles_local_order
@handles_split
def softmax(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 1, "dim"), "normalizes (softmax)", ATTENTION_FIX)


@dispatch.handles_local_order
@handles_split
def normalize(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 2, "dim", 1), "normalizes", "Normalize over the hidden dim")


@dispatch.handles_local_order
@handles_split
def scan(a, node: fx.Node) -> object:
    """cumsum / cumprod / cummax / cummin / logcumsumexp."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    tuple_out = 2 if name in ("cummax", "cummin") else 0
    return along_dim(
        a,
        node,
        arg(node, 1, "dim"),
        f"takes a running {name}",
        "Compute it in the data pipeline",
        tuple_out=tuple_out,
    )


@dispatch.handles_local_order
@handles_split
def sort(a, node: fx.Node) -> object:
    """sort / argsort / topk / kthvalue / msort: values (and indices) along a dim."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    index = {"topk": 2, "kthvalue": 2}.get(name, 1)
    tuple_out = 0 if name in ("argsort", "msort") else 2
    dims = normalize_dims(arg(node, index, "dim", -1), ndim(node.args[0]))
    if name in ("sort", "argsort") and dispatch.sorts_local_tokens(a, node, dims):
        return dispatch.sorted_rows(a, node, tuple_out)
    return along_dim(
        a,
        node,
        arg(node, index, "dim", -1),
        f"orders values ({name})",
        "Order along other dims",
        tuple_out=tuple_out,
    )


@dispatch.handles_local_order
@handles_split
def flip(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 1, "dims"), "reverses", "Reverse in the data pipeline")


@dispatch.handles_local_order
@handles_split
def roll(a, node: fx.Node) -> Layout:
    dims = arg(node, 2, "dims")
    if dims is None:  # rolls the flattened tensor
        dims = list(range(ndim(node.args[0])))
    return along_dim(a, node, dims, "rolls values", "Shift with slices (x[:, 1:]) or in the data pipeline")


@dispatch.handles_local_order
@handles_split
def diff(a, node: fx.Node) -> Layout:
    return along_dim(
        a, node, arg(node, 2, "dim", -1), "takes differences of neighbors", "Compute it in the data pipeline"
    )


@dispatch.handles_local_order
@handles_split
def repeat_interleave(a, node: fx.Node) -> Layout:
    """Repeats along a dim (K/V heads for grouped-query attention); along the sequence it mixes."""
    a.shape_use(*node.args[1:], *node.kwargs.values())
    dim = arg(node, 2, "dim")
    if dim is None:
        return a.refuse(node, "repeats the flattened tensor", "Pass dim= to repeat_interleave")
    return along_dim(a, node, dim, "repeats values", "Repeat along other dims", keeps_blocks=True)


@dispatch.handles_local_order
@handles_split
def triangle(a, node: fx.Node) -> Layout:
    """tril / triu over the last two dims: a mask's [S_r, S_r] block stays a mask; one sequence dim mixes."""
    materialize_all(a, node)
    layout = a.layout(node.args[0])
    rank = ndim(node.args[0])
    last_two = {rank - 2, rank - 1}
    if layout.is_local_order and 0 in last_two:
        return a.refuse(node, f"keeps a triangle across rows of this rank's tokens ({layout})", dispatch.FIX)
    if layout.is_split and layout.split in last_two:
        a.sequence_home(node.args[0])
        return triangle(a, node)
    if layout.is_split:
        return layout
    inside = last_two & set(layout.dims)
    if inside and inside != last_two:
        return a.mixes(node, "keeps a triangle of a matrix with one sequence dim", layout, ATTENTION_FIX)
    return layout


@dispatch.handles_local_order
def norm_over_last(a, node: fx.Node) -> Layout:
    """layer_norm / rms_norm: normalized over the trailing ``normalized_shape`` dims."""
    materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    normalized = arg(node, 1, "normalized_shape")
    count = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    if any(d >= ndim(source) - count for d in layout.dims):
        return a.refuse(node, "normalizes over the sequence dim", "Normalize over the hidden dim")
    return layout


def norm_over_channels(a, node: fx.Node) -> Layout:
    """batch_norm / instance_norm / group_norm: statistics over the batch or spatial dims."""
    materialize_all(a, node)
    layout = a.layout(node.args[0])
    if any(d != 1 for d in layout.dims):
        return a.refuse(
            node,
            "takes statistics over the sequence (batch/instance/group norm)",
            "Use LayerNorm or RMSNorm over the hidden dim",
        )
    return layout


# --------------------------------------------------------------------------------------------------
# reductions


_SUMS = {"sum", "nansum", "count_nonzero"}
_MEANS = {"mean", "nanmean"}
_EXTREMA = {"amax": "max", "amin": "min", "max": "max", "min": "min", "any": "max", "all": "min"}


@dispatch.handles_local_order
@handles_split
def reduction(a, node: fx.Node) -> Decided:
    """sum / mean / amax / amin / max / min / any / all / prod / std / var / norm / logsumexp / argmax..."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    source = node.args[0]
    layout = a.layout(source)
    rank = ndim(source)
    dims_after_order = name in ("norm", "linalg_vector_norm", "vector_norm")  # (x, p, dim, keepdim)
    dims_arg = arg(node, 2 if dims_after_order else 1, "dim")
    if name in ("max", "min") and isinstance(dims_arg, fx.Node):  # max(x, y): elementwise
        return pointwise(a, node)
    keepdim = bool(arg(node, 3 if dims_after_order else 2, "keepdim", False))
    reduced = normalize_dims(dims_arg, rank)
    returns_indices = name in ("max", "min", "median", "mode") and dims_arg is not None
    if layout == PARTIAL:
        if name in _SUMS - {"count_nonzero"}:
            return PARTIAL
        a.materialize(source)
        return REPLICATE
    if layout.kind in ("rows", "inverse"):
        return dispatch.reduce_rows(a, node, layout, reduced)
    if layout.is_split and layout.split in reduced:
        if set(layout.dims) <= set(reduced) and name in _SUMS | _MEANS - {"count_nonzero"}:
            # the sums of the ranks' blocks add up to the whole sum; a mean divides by the dims' whole
            # sizes, as traced
            return decide(PARTIAL, "reductions") if name in _MEANS else PARTIAL
        layout = a.sequence_home(source)
    where = reduced_positions(rank, reduced, keepdim)
    remaining = layout.mapped(where)
    if layout.is_split:  # its sequence is whole: reduced here completely, for this rank's block
        return (remaining, remaining) if returns_indices else remaining
    over_sequence = set(reduced) & set(layout.dims)
    if not over_sequence:
        return (remaining, remaining) if returns_indices else remaining
    if remaining.kind in ("shard", "global") or layout.kind != "shard":
        out = (remaining, remaining) if returns_indices else remaining
        return a.mixes(
            node, f"reduces ({name}) over part of a pairwise sequence value", out, "Reduce over both"
        )
    if name in _SUMS:
        return PARTIAL
    if name in _MEANS:
        return decide(PARTIAL, "reductions")
    if name in _EXTREMA:
        if returns_indices and _indices_used(node):
            return a.mixes(
                node,
                f"takes the position of the {name} over the sequence",
                (REPLICATE, REPLICATE),
                "Take only the values",
            )
        return decide((REPLICATE, REPLICATE) if returns_indices else REPLICATE, "extrema")
    if node not in a.token_data:  # std, logsumexp, median...: on the whole sequence for a block
        operand = Operand(source, {d: d for d in range(rank)})
        out_dim = choose(a, [operand], [d for d in range(rank) if d not in reduced])
        regrouped = align(a, [operand], out_dim, rank) if out_dim is not None else None
        if regrouped is not None:
            return reduction(a, node)
    out = (REPLICATE, REPLICATE) if returns_indices else REPLICATE
    return a.mixes(
        node, f"reduces ({name}) over the sequence", out, no_split_fix(a, source, "Reduce with sum or mean")
    )


def _indices_used(node: fx.Node) -> bool:
    import operator

    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users)


@dispatch.handles_local_order
def histogram(a, node: fx.Node) -> Layout:
    """histc / bincount: counts over tokens are sums of one-hot rows (a partial sum); of a mixture of
    experts' sorted slots, the group sizes of their rows (``dispatch.py``)."""
    local = dispatch.counts(a, node)
    if local is not None:
        return local
    layout = a.layout(node.args[0])
    if layout.kind == "shard" and (node in a.token_data or _fixed_bins(node)):
        return PARTIAL
    return a.refuse(
        node,
        "counts values over the sequence of activations into bins that depend on the values",
        "Count into fixed bins: torch.histc(x, bins, min=lo, max=hi) with lo < hi",
    )


def _fixed_bins(node: fx.Node) -> bool:
    """histc with explicit bounds (a router's tokens per expert): every rank counts its own tokens into the
    same bins, so the counts add up over ranks. With ``min == max`` histc takes the bounds from the data
    (each rank's own), and bincount's length is the largest value plus one: neither adds up."""
    if op_name(node) != "histc":
        return False
    args = bind(node, _HISTC)
    low, high = args.get("min", 0), args.get("max", 0)
    return isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high


_HISTC = inspect.signature(lambda input, bins=100, min=0, max=0: None)


# --------------------------------------------------------------------------------------------------
# losses


_LOSS_SIGNATURES = {
    "cross_entropy": inspect.signature(F.cross_entropy),
    "nll_loss": inspect.signature(F.nll_loss),
}


def class_loss(a, node: fx.Node) -> Decided:
    """cross_entropy / nll_loss: class dim 1 (0 for a 1-D input); every other dim indexes tokens."""
    materialize_all(a, node)
    source, target = node.args[0], arg(node, 1, "target")
    layout, target_layout = a.layout(source), a.layout(target)
    if 1 % max(ndim(source), 1) in layout.dims and ndim(source) > 1:
        return a.refuse(
            node,
            "takes classes along the sequence dim",
            "Put the vocabulary in dim 1 (or last, flattened to [N, V])",
        )
    if layout.kind == "replicate" and target_layout.kind == "replicate":
        return REPLICATE
    token_dims_in = {d if d == 0 else d - 1 for d in layout.dims}
    if layout.kind != "shard" or target_layout.kind != "shard" or set(target_layout.dims) != token_dims_in:
        return a.refuse(
            node,
            f"pairs logits ({layout}) with targets ({target_layout}) that are not sharded alike",
            "Shard the labels with the inputs (same length as input_ids, or shift them inside the step)",
        )
    args = bind(node, _LOSS_SIGNATURES[op_name(node)])
    for name in ("size_average", "reduce"):
        if args[name] is not None:
            return a.refuse(node, f"uses the deprecated {name}", "Use reduction= instead")
    reduction_kind = args["reduction"]
    if reduction_kind == "none":
        return target_layout
    if reduction_kind == "sum":
        return PARTIAL
    return decide(REPLICATE, "losses")


def elementwise_loss(a, node: fx.Node) -> Decided:
    """mse_loss / l1_loss / smooth_l1_loss / huber_loss / binary_cross_entropy(_with_logits) / kl_div."""
    decided = pointwise(a, node)
    layout = layout_of(decided)
    reduction_kind = node.kwargs.get("reduction", "mean")
    if layout == REPLICATE or reduction_kind == "none":
        return decided
    if reduction_kind == "sum":
        return relayout(decided, PARTIAL)
    if reduction_kind == "batchmean" and 0 not in layout.dims:  # sum / batch size: the batch is whole
        return relayout(decided, PARTIAL)
    return relayout(decided, PARTIAL, "reductions")
