"""Rules for ops that read across a dim: matmuls, norms, softmax, scans, sorts, reductions, losses, attention.

Across any dim but the sequence they propagate. Across the sequence: attention is rewritten (all-to-all,
``attention.py``); a sum becomes ``PARTIAL``, a mean a sum over the global count, a max an all-reduce
(``losses.py``); cross-entropy and NLL keep their mean over the valid tokens of the whole sequence;
scans and sorts of token data are recomputed for the whole sequence; on activations they are refused.
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.fx_utils import bind, meta_value, op_name
from lightning_autosp.compiler.layout import CAUSAL, PARTIAL, REPLICATE, Layout, shard
from lightning_autosp.compiler.rules.common import arg, ndim, normalize_dims, reduced_positions, tensor_nodes
from lightning_autosp.compiler.rules.elementwise import pointwise

_ATTENTION_FIX = (
    "Compute attention with torch.nn.functional.scaled_dot_product_attention (HF: "
    "attn_implementation='sdpa') "
    "or flash-attn's flash_attn_func, which the SP pass rewrites"
)


def _materialize_all(a, node: fx.Node) -> list[Layout]:
    tensors = tensor_nodes([*node.args, *node.kwargs.values()])
    for tensor in tensors:
        a.materialize(tensor)
    return [REPLICATE if a.layout(t) == PARTIAL else a.layout(t) for t in tensors]


def along_dim(a, node: fx.Node, dim: object, what: str, fix: str, *, tuple_out: int = 0) -> object:
    """An op that reads across ``dim`` and keeps the shape (softmax, cumsum, sort, flip, roll...)."""
    _materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    dims = normalize_dims(dim, ndim(source))
    out = (layout,) * tuple_out if tuple_out else layout
    if set(dims) & set(layout.dims):
        return a.mixes(node, what, out, fix)
    return out


def softmax(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 1, "dim"), "normalizes (softmax)", _ATTENTION_FIX)


def normalize(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 2, "dim", 1), "normalizes", "Normalize over the hidden dim")


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


def sort(a, node: fx.Node) -> object:
    """sort / argsort / topk / kthvalue / msort: values (and indices) along a dim."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    index = {"topk": 2, "kthvalue": 2}.get(name, 1)
    tuple_out = 0 if name in ("argsort", "msort") else 2
    return along_dim(
        a,
        node,
        arg(node, index, "dim", -1),
        f"orders values ({name})",
        "Order along other dims",
        tuple_out=tuple_out,
    )


def flip(a, node: fx.Node) -> Layout:
    return along_dim(a, node, arg(node, 1, "dims"), "reverses", "Reverse in the data pipeline")


def roll(a, node: fx.Node) -> Layout:
    dims = arg(node, 2, "dims")
    if dims is None:  # rolls the flattened tensor
        dims = list(range(ndim(node.args[0])))
    return along_dim(a, node, dims, "rolls values", "Shift with slices (x[:, 1:]) or in the data pipeline")


def diff(a, node: fx.Node) -> Layout:
    return along_dim(
        a, node, arg(node, 2, "dim", -1), "takes differences of neighbors", "Compute it in the data pipeline"
    )


def repeat_interleave(a, node: fx.Node) -> Layout:
    """Repeats along a dim (K/V heads for grouped-query attention); along the sequence it mixes."""
    a.shape_use(*node.args[1:], *node.kwargs.values())
    dim = arg(node, 2, "dim")
    if dim is None:
        return a.refuse(node, "repeats the flattened tensor", "Pass dim= to repeat_interleave")
    return along_dim(a, node, dim, "repeats values", "Repeat along other dims")


def triangle(a, node: fx.Node) -> Layout:
    """tril / triu over the last two dims: a mask's [S_r, S_r] block stays a mask; one sequence dim mixes."""
    _materialize_all(a, node)
    layout = a.layout(node.args[0])
    rank = ndim(node.args[0])
    last_two = {rank - 2, rank - 1}
    inside = last_two & set(layout.dims)
    if inside and inside != last_two:
        return a.mixes(node, "keeps a triangle of a matrix with one sequence dim", layout, _ATTENTION_FIX)
    return layout


def convolution(a, node: fx.Node) -> Layout:
    """conv1d / conv2d / conv3d and their transposes over [N, C, *spatial]: along the spatial dims each
    output reads neighbours, which at a shard's edge live on the next rank."""
    _materialize_all(a, node)
    layout = a.layout(node.args[0])
    if any(d >= 2 for d in layout.dims):
        return a.refuse(
            node,
            "convolves along the sequence: outputs at a shard's edge need the neighbouring rank's tokens",
            "Put the sequence in the batch or channel dim, or convolve in the data pipeline",
        )
    return layout


def norm_over_last(a, node: fx.Node) -> Layout:
    """layer_norm / rms_norm: normalized over the trailing ``normalized_shape`` dims."""
    _materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    normalized = arg(node, 1, "normalized_shape")
    count = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    if any(d >= ndim(source) - count for d in layout.dims):
        return a.refuse(node, "normalizes over the sequence dim", "Normalize over the hidden dim")
    return layout


def norm_over_channels(a, node: fx.Node) -> Layout:
    """batch_norm / instance_norm / group_norm: statistics over the batch or spatial dims."""
    _materialize_all(a, node)
    layout = a.layout(node.args[0])
    if any(d != 1 for d in layout.dims):
        return a.refuse(
            node,
            "takes statistics over the sequence (batch/instance/group norm)",
            "Use LayerNorm or RMSNorm over the hidden dim",
        )
    return layout


def linear(a, node: fx.Node) -> Layout:
    layouts = _materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    if any(layout.kind != "replicate" for layout in layouts[1:]):
        return a.refuse(node, "multiplies by a weight that holds sequence data", "Keep weights replicated")
    if ndim(source) - 1 in layout.dims:
        return a.refuse(node, "contracts over the sequence dim", _ATTENTION_FIX)
    return layout


def matmul(a, node: fx.Node) -> Layout:
    """matmul / @ / mm / bmm: contracts the last dim of the left with the second-last of the right."""
    _materialize_all(a, node)
    return _product(a, node, node.args[0], node.args[1])


def add_product(a, node: fx.Node) -> Layout:
    """addmm / baddbmm (GPT-2's Conv1D): ``beta * input + alpha * (left @ right)`` with a replicated input."""
    _materialize_all(a, node)
    bias, left, right = node.args[:3]
    if a.layout(bias) != REPLICATE:
        return a.refuse(node, "adds a product to a value that holds sequence data", "Add the bias separately")
    return _product(a, node, left, right)


def _product(a, node: fx.Node, left: fx.Node, right: fx.Node) -> Layout:
    lay_l, lay_r = a.layout(left), a.layout(right)
    rank_l, rank_r, rank = ndim(left), ndim(right), ndim(node)
    contracted = (
        (rank_l - 1 in lay_l.dims)
        or (rank_r >= 2 and rank_r - 2 in lay_r.dims)
        or (rank_r == 1 and 0 in lay_r.dims)
    )
    if contracted:
        return a.mixes(
            node,
            "multiplies matrices over the sequence dim (attention written by hand?)",
            REPLICATE,
            _ATTENTION_FIX,
        )
    dims = {d + rank - rank_l for d in lay_l.dims}
    if rank_r >= 2:
        dims |= {d + rank - rank_r for d in lay_r.dims if d != rank_r - 1} | (
            {rank - 1} if rank_r - 1 in lay_r.dims else set()
        )
    if rank_l >= 2 and rank_l - 2 in lay_l.dims and rank_r >= 2 and rank_r - 1 in lay_r.dims:
        return a.mixes(
            node,
            "forms a [tokens x tokens] matrix of activations (attention written by hand?)",
            shard(*dims),
            _ATTENTION_FIX,
        )
    return shard(*dims)


def embedding(a, node: fx.Node) -> Layout:
    _materialize_all(a, node)
    indices, weight = node.args[0], node.args[1]
    if a.layout(weight) != REPLICATE:
        return a.refuse(node, "looks up a table that holds sequence data", "Keep embedding tables replicated")
    return a.layout(indices)


def one_hot(a, node: fx.Node) -> Layout:
    return a.layout(node.args[0])


# --------------------------------------------------------------------------------------------------
# reductions


_SUMS = {"sum", "nansum", "count_nonzero"}
_MEANS = {"mean", "nanmean"}
_EXTREMA = {"amax": "max", "amin": "min", "max": "max", "min": "min", "any": "max", "all": "min"}


def reduction(a, node: fx.Node) -> object:
    """sum / mean / amax / amin / max / min / any / all / prod / std / var / norm / logsumexp / argmax..."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    source = node.args[0]
    layout = a.layout(source)
    rank = ndim(source)
    dims_arg = arg(node, 1, "dim") if name not in ("norm",) else arg(node, 2, "dim")
    if name in ("max", "min") and isinstance(dims_arg, fx.Node):  # max(x, y): elementwise
        return pointwise(a, node)
    keepdim = bool(arg(node, 2 if name not in ("norm",) else 3, "keepdim", False))
    reduced = normalize_dims(dims_arg, rank)
    returns_indices = name in ("max", "min", "median", "mode") and dims_arg is not None
    if layout == PARTIAL:
        if name in _SUMS - {"count_nonzero"}:
            return PARTIAL
        a.materialize(source)
        return REPLICATE
    where = reduced_positions(rank, reduced, keepdim)
    remaining = layout.mapped(where)
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
        a.plan.reductions.append(node)
        return PARTIAL
    if name in _EXTREMA:
        if returns_indices and _indices_used(node):
            return a.mixes(
                node,
                f"takes the position of the {name} over the sequence",
                (REPLICATE, REPLICATE),
                "Take only the values",
            )
        a.plan.extrema.append(node)
        return (REPLICATE, REPLICATE) if returns_indices else REPLICATE
    out = (REPLICATE, REPLICATE) if returns_indices else REPLICATE
    return a.mixes(node, f"reduces ({name}) over the sequence", out, "Reduce with sum, mean, max or min")


def _indices_used(node: fx.Node) -> bool:
    import operator

    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users)


def histogram(a, node: fx.Node) -> Layout:
    """histc / bincount: counts over tokens are sums of one-hot rows (a partial sum)."""
    layout = a.layout(node.args[0])
    if layout.kind == "shard" and node in a.token_data:
        return PARTIAL
    return a.refuse(node, "counts values over the sequence of activations", "Count token data")


# --------------------------------------------------------------------------------------------------
# losses


_LOSS_SIGNATURES = {
    "cross_entropy": inspect.signature(F.cross_entropy),
    "nll_loss": inspect.signature(F.nll_loss),
}


def class_loss(a, node: fx.Node) -> Layout:
    """cross_entropy / nll_loss: class dim 1 (0 for a 1-D input); every other dim indexes tokens."""
    _materialize_all(a, node)
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
    a.plan.losses.append(node)
    return REPLICATE


def elementwise_loss(a, node: fx.Node) -> Layout:
    """mse_loss / l1_loss / smooth_l1_loss / huber_loss / binary_cross_entropy(_with_logits) / kl_div."""
    layout = pointwise(a, node)
    reduction_kind = node.kwargs.get("reduction", "mean")
    if layout == REPLICATE or reduction_kind == "none":
        return layout
    if reduction_kind == "sum":
        return PARTIAL
    if reduction_kind == "batchmean" and 0 not in layout.dims:
        return PARTIAL  # sum / batch size: the batch is not sharded
    a.plan.reductions.append(node)
    return PARTIAL


# --------------------------------------------------------------------------------------------------
# attention


def sdpa(a, node: fx.Node) -> Layout:
    query, key, value = (arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
    layouts = [a.layout(t) for t in (query, key, value)]
    mask = arg(node, 3, "attn_mask")
    if all(layout == REPLICATE for layout in layouts):
        return REPLICATE if a.layout(mask) in (REPLICATE, CAUSAL) else _refuse_mask(a, node)
    seq = ndim(query) - 2
    if any(layout != shard(seq) for layout in layouts):
        return a.refuse(
            node,
            f"attends with q/k/v of layouts {[str(layout) for layout in layouts]}; only "
            "self-attention over the "
            f"sharded sequence (its dim {seq}) is supported",
            "Attend over the sequence the batch carries (no cross-attention to other sequences)",
        )
    mask_layout = a.layout(mask)
    if mask_layout.kind == "shard" and mask not in a.token_data:
        return _refuse_mask(a, node)
    if mask_layout == PARTIAL:
        a.materialize(mask)
    a.plan.attention.append(node)
    return shard(seq)


def _refuse_mask(a, node: fx.Node) -> Layout:
    return a.refuse(
        node,
        "uses an attention mask computed from activations or parameters, which cannot be rebuilt for "
        "the whole sequence",
        "Build masks from sizes or per-token inputs (positions, document ids, padding), or use "
        "is_causal=True",
    )


def flash(a, node: fx.Node) -> object:
    match = a.flash_matches.get(node)
    if match is None:
        return a.refuse(node, "is an attention kernel the SP pass does not know", _ATTENTION_FIX)
    layouts = [a.layout(match.operands[name]) for name in ("q", "k", "v")]
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if name in match.operands and a.layout(match.operands[name]) != REPLICATE:
            return a.refuse(
                node,
                f"{name} is computed from the sequence (this rank's shard), but after the all-to-all "
                "attention runs over the whole row",
                "Put the cu_seqlens of the whole packed row in the batch (one row per batch)",
            )
    seq = match.seq_dim
    if any(layout.flat for layout in layouts):
        return a.refuse(
            node,
            "flash_attn_varlen_func over a batch flattened to B * S_r tokens",
            "Use one packed row per batch (batch size 1) and mark its documents with cu_seqlens",
        )
    if any(layout != shard(seq) for layout in layouts):
        return a.refuse(node, f"flash-attn with q/k/v of layouts {[str(x) for x in layouts]}", _ATTENTION_FIX)
    a.plan.attention.append(node)
    value = meta_value(node)
    count = len(value) if isinstance(value, (tuple, list)) else 1
    return (shard(seq),) * count if isinstance(value, (tuple, list)) else shard(seq)


def refuse_subgraph(a, node: fx.Node) -> Layout:
    return a.refuse(
        node,
        "runs sequence data through a region the pass cannot see into (activation checkpointing, a custom "
        "autograd.Function, torch.cond)",
        "Turn off the model's gradient checkpointing (AutoSPStrategy's sac=True recomputes "
        "activations already) and write custom Functions' math inline",
    )
