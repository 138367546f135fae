"""Rules for ops that cut or pick along dims: slices, narrows, selections, indexing, indexed writes.

Slices along the sequence are rewritten to slice the global sequence (``slices.py``); a replicated table
sliced by the length (``pos_emb[:, :T]``, a rope cache) gives its rows at this rank's positions
(``positions.py``); positions picked along the sequence of an activation (``x[:, -1]``) are a partial sum
(``slices.py``: selections); a mixture of experts' gathers follow its token permutation (``dispatch.py``);
anything else that picks tokens by index is recomputed whole for token data and refused otherwise.
"""

from __future__ import annotations

import torch
from torch import fx

from lightning_autosp.compiler.fx_utils import index_items, meta_value, op_name
from lightning_autosp.compiler.prove.layout import PARTIAL, REFUSED, REPLICATE, Layout, shard
from lightning_autosp.compiler.prove.plan import Decided, decide
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import (
    INDEX_FIX,
    arg,
    ndim,
    normalize_dims,
    restore_sequence_dims,
    sequence_dims_of_output,
    tensor_nodes,
)
from lightning_autosp.compiler.prove.rules.split import handles_split, to_whole_sequence


@dispatch.handles_local_order
@handles_split
def getitem(a, node: fx.Node) -> Decided:
    source, index = node.args
    layouts = a.layouts.get(source)
    if isinstance(layouts, tuple):  # an element of a tuple-valued op (split, topk, max(dim))
        return layouts[index] if isinstance(index, int) and index < len(layouts) else REPLICATE
    if not isinstance(meta_value(source), torch.Tensor):
        return REPLICATE
    rank = ndim(source)
    items = index_items(index, rank)
    items += [slice(None)] * (rank - sum(1 for item in items if item is not None))
    tensor_items = [
        item for item in items if isinstance(item, fx.Node) and isinstance(meta_value(item), torch.Tensor)
    ]
    if a.layout(source).is_split:
        return _getitem_of_split(a, node, items, tensor_items)
    if len(tensor_items) == 1 and items[0] is tensor_items[0]:  # x[index] along dim 0
        permuted = dispatch.gather(a, node, source, tensor_items[0])
        if permuted is not None:
            return permuted
    if a.layout(source).is_local_order and not (items and _is_full(a, items[0])):
        return a.refuse(node, f"indexes the row dim of {a.layout(source)}", dispatch.FIX)
    if tensor_items:
        return _advanced_index(a, node, items, tensor_items)
    a.shape_use(*[v for item in items if isinstance(item, slice) for v in (item.start, item.stop, item.step)])
    layout = a.layout(source)
    if layout == PARTIAL:
        return PARTIAL
    where, in_dim, out_dim = {}, 0, 0
    sliced_sequence, table_dims = False, []
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if isinstance(item, slice):
            if in_dim in layout.dims and not _is_full(a, item):
                sliced_sequence = True
                if in_dim in layout.flat:
                    return a.mixes(
                        node, "slices a dim that flattens tokens with other dims", layout, INDEX_FIX
                    )
                if item.step not in (None, 1):
                    return a.mixes(node, "takes a strided slice", layout, "Use step 1 along the sequence")
            elif layout == REPLICATE and _bounded_by_length(a, item):
                table_dims.append((item, out_dim))
            where[in_dim] = out_dim
            out_dim += 1
        else:  # an int: selects one position
            if in_dim in layout.dims:
                return _position(a, node, layout, layout.mapped(where))
            where[in_dim] = None
        in_dim += 1
    if len(table_dims) == 1:
        return _table_slice(a, node, *table_dims[0])
    if table_dims:  # buffer[:T, :T]: a [T, T] block of a mask, rebuilt where attention uses it
        return shard(*(dim for _, dim in table_dims))
    if sliced_sequence:
        if layout.kind != "shard" or layout.is_pairwise:
            return a.mixes(node, "slices a mask along the sequence", layout.mapped(where), INDEX_FIX)
        return decide(layout.mapped(where), "slices")
    return layout.mapped(where)


def _getitem_of_split(a, node: fx.Node, items: list, tensor_items: list) -> Decided:
    """Basic indexing of a split value: its sequence dims are whole, so any slice of them is taken as
    written (at the global length); the split dim itself must stay whole."""
    source = node.args[0]
    layout = a.layout(source)
    a.shape_use(*[v for item in items if isinstance(item, slice) for v in (item.start, item.stop, item.step)])
    where, indexed, _ = _basic_index(items)
    if tensor_items or any(dim == layout.split and not _is_whole(a, item) for dim, item in indexed):
        if a.sequence_home(source) == REFUSED:  # no way back to shards: the refusal says why
            return REFUSED
        return getitem(a, node)
    return restore_sequence_dims(a, node, layout.mapped(where))


def _basic_index(items: list) -> tuple[dict[int, int | None], list[tuple[int, object]], int]:
    """Basic index items (slices, ints, None) -> where each input dim goes (None: picked away), each
    input dim with the item that indexes it, and the number of output dims."""
    where: dict[int, int | None] = {}
    indexed: list[tuple[int, object]] = []
    out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        in_dim = len(indexed)
        indexed.append((in_dim, item))
        where[in_dim] = out_dim if isinstance(item, slice) else None
        out_dim += isinstance(item, slice)
    return where, indexed, out_dim


def _is_full(a, item: slice) -> bool:
    return item.start in (None, 0) and item.step in (None, 1) and item.stop is None


def _is_whole(a, item: object) -> bool:
    """An index item that keeps its dim whole (``:``)."""
    return isinstance(item, slice) and _is_full(a, item)


def _bounded_by_length(a, item: slice) -> bool:
    return any(a.has_sequence_symbol(a.size_expr(v)) for v in (item.start, item.stop, item.step))


def _table_slice(a, node: fx.Node, item: slice, out_dim: int) -> Decided:
    """``table[:T]`` of a replicated table (learned positions, a rope cache): rows at this rank's "
    "positions."""
    start, step = a.size_expr(item.start), a.size_expr(item.step)
    if (item.start is not None and start != 0) or (item.step is not None and step != 1):
        return a.refuse(
            node,
            f"slices a replicated table by the sequence length with start {item.start} / step {item.step}",
            "Slice position tables from 0 (table[:T]), or index them with position ids",
        )
    return decide(shard(out_dim), "tables")


def _advanced_index(a, node: fx.Node, items: list, tensor_items: list[fx.Node]) -> Decided:
    """``x[..., idx, ...]``: one tensor index on a dim that is not the sequence (a table looked up by
    per-token ids) propagates; indexing along the sequence is recomputed (token data) or refused."""
    source = node.args[0]
    layout = a.layout(source)
    indexed = [d for d, item in enumerate(i for i in items if i is not None) if isinstance(item, fx.Node)]
    cut = any(
        isinstance(item, slice) and d in layout.dims and not _is_full(a, item) for d, item in enumerate(items)
    )
    index_layouts = [a.layout(t) for t in tensor_items]
    for tensor in tensor_items:
        a.materialize(tensor)
    index_layouts = [a.layout(t) for t in tensor_items]
    along = [d for d in indexed if d in layout.dims]
    if along and not cut and all(x == REPLICATE for x in index_layouts) and a.context.shard.is_contiguous:
        # positions of the whole sequence (a classifier's last token): each rank picks those it holds
        return _position(a, node, layout, REPLICATE)
    if len(tensor_items) > 1 or cut or along:
        out = shard(*sequence_dims_of_output(a, node))
        return a.mixes(node, "indexes along the sequence with a tensor of indices", out, INDEX_FIX)
    if layout.kind not in ("shard", "replicate") or index_layouts[0].kind not in ("shard", "replicate"):
        return a.refuse(node, "indexes a value of layout {layout} by {index_layouts[0]}", INDEX_FIX)
    (position,) = indexed
    index_rank = ndim(tensor_items[0])
    where = {d: (d if d < position else d - 1 + index_rank) for d in range(ndim(source)) if d != position}
    out = layout.mapped(where)
    dims = set(out.dims) | {position + d for d in index_layouts[0].dims}
    flat = set(out.flat) | {position + d for d in index_layouts[0].flat}
    return shard(*dims, flat=tuple(flat))


@handles_split
def narrow(a, node: fx.Node) -> Decided:
    a.shape_use(*node.args[1:], *node.kwargs.values())
    source, rank = node.args[0], ndim(node.args[0])
    layout = a.layout(source)
    if layout == PARTIAL:
        return PARTIAL
    dim = normalize_dims(arg(node, 1, "dim"), rank)[0]
    if layout.is_split and dim != layout.split:  # the sequence is whole: cut as written, at its length
        cut = Layout(
            "split",
            tuple(d for d in layout.dims if d != dim),
            tuple(d for d in layout.flat if d != dim),
            layout.split,
            tuple(pair for pair in layout.chunks if dim not in pair),
        )
        return restore_sequence_dims(a, node, cut)  # the cut dim is the sequence again if as long
    if layout.is_split:
        layout = a.sequence_home(source)
    if layout == REPLICATE and a.has_sequence_symbol(a.size_expr(arg(node, 3, "length"))):
        return _table_slice(a, node, slice(arg(node, 2, "start"), None), dim)
    if dim in layout.dims:
        if dim in layout.flat or layout.kind != "shard" or layout.is_pairwise:
            return a.mixes(node, "narrows a flattened or pairwise sequence dim", layout, INDEX_FIX)
        if op_name(node) == "slice" and arg(node, 4, "step", 1) not in (None, 1):
            if to_whole_sequence(a, source):  # every other token: on the whole sequence for a block
                return narrow(a, node)
            return a.mixes(node, "takes a strided slice", layout, "Use step 1 along the sequence")
        return decide(layout, "slices")
    return layout


def select(a, node: fx.Node) -> Decided:
    source, rank = node.args[0], ndim(node.args[0])
    layout = a.layout(source)
    if layout == PARTIAL:
        return PARTIAL
    dim = normalize_dims(arg(node, 1, "dim"), rank)[0]
    where = {d: (d if d < dim else d - 1) for d in range(rank) if d != dim}
    if dim in layout.dims:
        return _position(a, node, layout, layout.mapped(where))
    return layout.mapped(where)


def _position(a, node: fx.Node, layout: Layout, out: Layout) -> Decided:
    """Positions picked along the sequence of an activation (``x[:, -1]``, ``x[arange(B), last]``): the
    rank holding a position gives it, the others zeros, so the result is a partial sum (DTensor's
    ``Partial``) that one all-reduce makes whole where it is needed (``slices.py``: selections)."""
    if node in a.token_data or layout.kind != "shard" or len(layout.dims) != 1 or layout.flat:
        return a.mixes(
            node,
            "selects single positions",
            out,
            "Pool over the sequence (e.g. a mean) or select the position in the data pipeline",
        )
    return decide(PARTIAL, "selections")


def index_along(a, node: fx.Node) -> Layout:
    """index_select / gather / take_along_dim / scatter / index_add / index_copy / index_fill."""
    rank = ndim(node.args[0])
    dim = normalize_dims(arg(node, 1, "dim"), rank)[0]
    layouts = [a.layout(t) for t in tensor_nodes(node.args)]
    if any(layout == PARTIAL for layout in layouts):
        for tensor in tensor_nodes(node.args):
            a.materialize(tensor)
    sequence = set().union(*(set(layout.dims) for layout in layouts if layout.kind == "shard"))
    if dim in sequence or any(layout.kind not in ("shard", "replicate", "partial") for layout in layouts):
        return a.mixes(
            node, "indexes along the sequence", shard(*sequence_dims_of_output(a, node)), INDEX_FIX
        )
    flat = set().union(*(set(layout.flat) for layout in layouts if layout.kind == "shard")) & sequence
    result = shard(*sequence, flat=tuple(flat))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    target = node.args[0]
    if name.endswith("_") and (a.moved(target) or a.layout(target) != result):  # in place: keeps its layout
        return a.refuse(
            node,
            f"writes a value of layout {result} in place into {target.name} ({a.layout(target)})",
            "Assign the result to a new tensor instead of updating one in place",
        )
    return result


@dispatch.handles_local_order
@handles_split
def setitem(a, node: fx.Node) -> Layout:
    if _assignment_into_a_block(a, node):
        return REPLICATE  # the assignment returns None; ``target`` keeps its layout
    for value in tensor_nodes(node.args):  # its other forms know sequence shards only
        if a.layout(value).is_split:
            a.sequence_home(value)
    inverse = dispatch.inverse(a, node)
    if inverse is not None:
        return inverse
    if _masked_fill(a, node) or _per_token_assignment(a, node):
        return REPLICATE  # the assignment returns None; ``target`` keeps its layout
    return a.refuse(
        node,
        "assigns into a tensor by index (x[i] = y) where sequence data is involved",
        "Build the tensor with torch.where or scatter instead of an indexed assignment",
    )


def _assignment_into_a_block(a, node: fx.Node) -> bool:
    """``out[:, :, i] = y`` into a value on the whole sequence for a block of a dim (a chunked scan's output
    buffer, split over heads), with basic indices that keep that dim whole and ``y`` split along the same
    dim of the slot, or a number: each rank writes its block from its block (Qwen3-Next's gated delta
    rule, traced at the whole sequence's length)."""
    target, index, value = node.args
    layout = a.layout(target)
    if not layout.is_split or a.moved(target) or not isinstance(meta_value(target), torch.Tensor):
        return False
    items = index_items(index, ndim(target))
    if any(isinstance(item, fx.Node) and isinstance(meta_value(item), torch.Tensor) for item in items):
        return False
    items += [slice(None)] * (ndim(target) - sum(1 for item in items if item is not None))
    a.shape_use(*[v for item in items if isinstance(item, slice) for v in (item.start, item.stop, item.step)])
    where, indexed, out_dim = _basic_index(items)
    if not any(dim == layout.split and _is_whole(a, item) for dim, item in indexed):
        return False  # the block's dim is cut or picked
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float, bool))
    written = a.layout(value)
    slot = layout.mapped(where)
    return written.is_split and written.split == slot.split and meta_value(value).dim() == out_dim


def _masked_fill(a, node: fx.Node) -> bool:
    """``x[mask] = value`` with a boolean ``mask`` of ``x``'s own shape and layout and one value for every
    picked element (a number or a replicated one-element tensor): ``masked_fill`` in place, which acts on
    each element alone (TRL's ``labels[labels == -100] = 0``), so every rank fills its own shard."""
    target, index, value = node.args
    mask = meta_value(index) if isinstance(index, fx.Node) else None
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return False
    if [str(d) for d in mask.shape] != [str(d) for d in meta_value(target).shape]:
        return False
    if a.layout(index) != a.layout(target):
        return False
    if isinstance(value, fx.Node):
        filled = meta_value(value)
        return isinstance(filled, torch.Tensor) and filled.numel() == 1 and a.layout(value) == REPLICATE
    return isinstance(value, (int, float, bool))


def _per_token_assignment(a, node: fx.Node) -> bool:
    """``x[..., 1:8:3] = y`` with basic indices (ints, slices, None) that leave every sequence dim of ``x``
    whole, and ``y`` a number, a replicated value without sequence dims, or a value laid out as
    ``x[..., 1:8:3]`` is: each token's row is written from the same token's row (Qwen3.5's rotary
    sections), so every rank writes its own shard."""
    target, index, value = node.args
    if not isinstance(meta_value(target), torch.Tensor) or a.moved(target):
        return False
    rank = ndim(target)
    items = index_items(index, rank)
    if any(isinstance(item, fx.Node) and isinstance(meta_value(item), torch.Tensor) for item in items):
        return False
    items += [slice(None)] * (rank - sum(1 for item in items if item is not None))
    layout = a.layout(target)
    if layout.kind not in ("shard", "replicate") or layout.flat or layout.is_pairwise:
        return False
    a.shape_use(*[v for item in items if isinstance(item, slice) for v in (item.start, item.stop, item.step)])
    where, indexed, out_dim = _basic_index(items)
    if any(dim in layout.dims and not _is_whole(a, item) for dim, item in indexed):
        return False  # cuts or picks along the sequence
    if not isinstance(value, fx.Node):
        return isinstance(value, (int, float, bool))
    written = meta_value(value)
    if not isinstance(written, torch.Tensor):
        return True  # a size or number computed in the graph
    if a.layout(value) == REPLICATE:
        return not sequence_dims_of_output(a, value)
    return a.layout(value) == layout.mapped(where) and written.dim() == out_dim
