"""Rules for ops that move, join or create dims: permutes, expands, pads, concatenation, splits, factories,
and the dim ``torch.vmap`` hides.

Right pads along the sequence pad the global sequence (``slices.py``); positions (``arange`` over the
length) become this rank's positions (``positions.py``). Views: ``views.py``; slices and indexing:
``indexing.py``.

Note [A dim hidden by vmap]
    Dynamo records ``torch.vmap(f)(x)`` as ``f``'s ops between ``_vmap_increment_nesting(batch_size)``,
    ``_add_batch_dim(x, in_dim, level)``, which hides dim ``in_dim`` (``f`` sees a value without it and
    runs on every slice alike), and ``_remove_batch_dim(y, level, batch_size, out_dim)``, which puts it
    back. torch's generic ``associative_scan`` (Jamba's Mamba scan) is such a recursion: halves of the
    sequence combined under vmap, interleaved, and again. Whatever ``f`` does to its visible dims, the
    hidden one is mapped over independently, so the rules judge ``f``'s ops on what they see, provided
    the hidden dim is one no layout tracks, or the whole sequence of a split value (every rank holds all
    of it, for a block of another dim) or of a replicated one (gathered whole). vmap over this rank's
    part of the sequence, or over the split dim, is refused: the batch size would then differ from rank
    to rank or from one device's. On a split or replicated value a batch size computed from the length
    is the whole sequence's, so it is a value (global) to both ``_vmap_increment_nesting`` and
    ``_remove_batch_dim``, and the dim put back is a sequence dim again where it is as long as the
    sequence (``global`` for a replicated value). The interleaved halves end as a dim the trace's guards
    prove as long as the sequence (``2 * ((s - 1) // 2) + 2`` where it guarded on ``s`` even):
    ``Analysis.shape`` gives such a size as the length (``symbols.as_length``).
"""

from __future__ import annotations

import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import flatten, meta_value, op_name
from lightning_autosp.compiler.prove.layout import PARTIAL, REPLICATE, Layout, global_, shard, split
from lightning_autosp.compiler.prove.plan import Decided, TokenInsertion, decide
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import (
    arg,
    ndim,
    normalize_dims,
    partial_passes,
    reduced_positions,
    restore_sequence_dims,
    sequence_dims_of_output,
    tensor_nodes,
)
from lightning_autosp.compiler.prove.rules.split import (
    Operand,
    align,
    handles_split,
)
from lightning_autosp.compiler.prove.rules.views import keeps_rows


@dispatch.handles_local_order
@handles_split
def permute(a, node: fx.Node) -> Layout:
    """permute / transpose / swapaxes / movedim / t / T / mT."""
    partial = partial_passes(a, node)
    if partial:
        return partial
    layout = a.layout(node.args[0])
    rank = ndim(node.args[0])
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    order = list(range(rank))
    if name == "permute":
        order = normalize_dims(flatten([list(node.args[1:]), node.kwargs.get("dims", [])]), rank)
    elif name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = normalize_dims([arg(node, 1, "dim0"), arg(node, 2, "dim1")], rank)
        order[d0], order[d1] = order[d1], order[d0]
    elif name in ("t", "T", "mT"):
        order[-2:] = order[-2:][::-1] if rank >= 2 else order[-2:]
    elif name == "movedim":
        source = normalize_dims(arg(node, 1, "source"), rank)
        destination = normalize_dims(arg(node, 2, "destination"), rank)
        rest = [d for d in range(rank) if d not in source]
        order = [None] * rank
        for s, d in zip(source, destination):
            order[d] = s
        order = [d if d is not None else rest.pop(0) for d in order]
    return layout.mapped({old: new for new, old in enumerate(order)})


@dispatch.handles_local_order
@handles_split
def expand(a, node: fx.Node) -> Decided:
    """expand / expand_as / broadcast_to / repeat / tile: a new sequence-sized dim repeats one value."""
    a.shape_use(*node.args[1:], *node.kwargs.values())
    partial = partial_passes(a, node)
    if partial:
        return partial
    source = node.args[0]
    layout = a.layout(source)
    offset = ndim(node) - ndim(source)
    dims = {d + offset for d in layout.dims}
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if layout.kind in ("rows", "inverse"):
        return (
            keeps_rows(a, node, source, layout)
            if offset == 0
            else a.refuse(node, f"adds dims before the row dim of {layout}", dispatch.FIX)
        )
    if layout.is_split:
        if name in ("repeat", "tile"):
            a.sequence_home(source)
            return expand(a, node)
        flat = tuple(d + offset for d in layout.flat)
        out = split(layout.split + offset, *(dims | sequence_dims_of_output(a, node)), flat=flat)
        return decide(out, "split_shapes")
    if name in ("repeat", "tile"):
        repeats = [
            symbols.hint(meta_value(r) if isinstance(r, fx.Node) else r)
            for r in flatten([*node.args[1:], *node.kwargs.values()])
        ]
        repeats = [1] * (ndim(node) - len(repeats)) + repeats  # tile's are aligned to the last dims
        if any(repeats[d] != 1 for d in dims if d < len(repeats)):
            return a.refuse(node, "repeats values along the sequence", "Repeat along other dims only")
    dims |= sequence_dims_of_output(a, node)
    if layout.kind == "global":
        return decide(Layout("global", tuple(sorted(dims))), "global_shapes")
    return shard(*dims, flat=tuple(d + offset for d in layout.flat))


@handles_split
def pad(a, node: fx.Node) -> Decided:
    a.shape_use(*node.args[1:])
    source, rank = node.args[0], ndim(node.args[0])
    layout = a.layout(source)
    pads = list(arg(node, 1, "pad"))
    touched = [rank - 1 - i for i in range(len(pads) // 2) if (pads[2 * i], pads[2 * i + 1]) != (0, 0)]
    if layout.is_split and layout.split in touched:
        layout = a.sequence_home(source)
    if layout.is_split:  # the sequence is whole: padded as written
        return layout
    sequence = [d for d in touched if d in layout.dims]
    if not sequence:
        return layout
    left = pads[2 * (rank - 1 - sequence[0])]
    mode = arg(node, 2, "mode", "constant")
    if (
        left
        or mode != "constant"
        or len(sequence) > 1
        or sequence[0] in layout.flat
        or layout.kind != "shard"
    ):
        return a.mixes(
            node,
            "pads the start of the sequence (or pads it other than with a constant)",
            layout,
            "Pad at the end of the sequence, or in the data pipeline",
        )
    return decide(layout, "slices")


# --------------------------------------------------------------------------------------------------
# torch.vmap's batch dim


@handles_split
def vmap_batch_dim(a, node: fx.Node) -> Decided:
    """``torch.vmap`` as Dynamo records it (Note [A dim hidden by vmap]): ``_add_batch_dim(x, in_dim,
    level)`` hides a dim, ``_remove_batch_dim(y, level, batch_size, out_dim)`` brings it back."""
    partial = partial_passes(a, node)
    if partial:
        return partial
    source = node.args[0]
    layout, rank = a.layout(source), ndim(source)
    if op_name(node) == "_add_batch_dim":
        hidden = normalize_dims(node.args[1], rank)[0]
        tracked = (
            hidden in layout.flat or layout.is_local_order or (layout.is_split and hidden == layout.split)
        )
        if tracked or (hidden in layout.dims and not layout.is_split):
            return a.refuse(
                node,
                f"maps a function over dim {hidden} of a value laid out {layout}, which holds this rank's "
                "part of the sequence (or of the heads) there",
                "Map over a dim the sequence does not run along, or write the loop with tensor ops",
            )
        return layout.mapped(reduced_positions(rank, [hidden], keepdim=False))
    batch_size, out_dim = node.args[2], normalize_dims(node.args[3], rank + 1)[0]
    out = layout.mapped({d: d + (d >= out_dim) for d in range(rank)})
    if not a.has_sequence_symbol(a.size_expr(batch_size)):
        return out
    a.shape_use(batch_size)
    if layout.is_split:  # the hidden dim held the whole sequence (or a part of it): global sizes
        return decide(restore_sequence_dims(a, node, out), "global_shapes")
    if layout == REPLICATE:  # gathered whole: a dim as long as the sequence holds all of it
        whole = [d for d, size in enumerate(a.shape(node) or ()) if size in a.lengths]
        return decide(global_(*whole), "global_shapes")
    return a.refuse(
        node,
        f"brings back a dim of {batch_size} elements, computed from the sequence length, into a value laid "
        f"out {layout}, which holds this rank's part of the sequence",
        "Map over a dim the sequence does not run along, or write the loop with tensor ops",
    )


def vmap_level(a, node: fx.Node) -> Layout:
    """``_vmap_increment_nesting(batch_size, randomness)``: the size of the dim vmap hides is a value to
    it, the global one where it is a length, which ``vmap_batch_dim`` allows only where the sequence is
    whole."""
    return REPLICATE


# --------------------------------------------------------------------------------------------------
# joining and splitting


@handles_split
def cat(a, node: fx.Node) -> Decided:
    """cat / concat: an operand with no elements adds nothing, so ``cat([empty, x])`` is ``x`` (HF's
    ``DynamicCache`` appends each layer's keys and values to an empty tensor, which training never reads
    again); joining pieces along the sequence is refused unless they are token data."""
    operands = tensor_nodes([arg(node, 0, "tensors")])
    tensors = [t for t in operands if not _has_no_elements(t)] or operands
    if len(tensors) == 1:
        return a.layout(tensors[0])
    rank = ndim(node)
    dim = normalize_dims(arg(node, 1, "dim", 0), rank)[0]
    split_side = [t for t in tensors if a.layout(t).is_split]
    if split_side:  # joined along another dim than the split one: on the whole sequence, any dim is fine
        out_dim = a.layout(split_side[0]).split
        joined = (
            None
            if dim == out_dim
            else align(a, [Operand(t, {d: d for d in range(rank)}) for t in tensors], out_dim, rank)
        )
        if joined is not None:
            return joined
        for tensor in split_side:
            a.sequence_home(tensor)
    layouts = [a.layout(t) for t in tensors]
    if all(layout == PARTIAL for layout in layouts):
        return PARTIAL
    for tensor in tensors:
        a.materialize(tensor)
    dims = {d for layout in layouts for d in layout.dims}
    if dim in dims:
        inserted = _inserted_tokens(a, node, operands, dim)
        if inserted is not None:
            return decide(shard(dim), inserted)
        return a.mixes(
            node, "concatenates along the sequence", shard(*dims), "Concatenate in the data pipeline"
        )
    if len({layout for layout in layouts if layout != PARTIAL}) > 1:
        return a.refuse(
            node, "concatenates values of different sequence layouts", "Concatenate like with like"
        )
    return layouts[0] if layouts[0] != PARTIAL else REPLICATE


def _inserted_tokens(a, node: fx.Node, operands: list[fx.Node], dim: int) -> TokenInsertion | None:
    """``cat([prefix..., x, suffix...], dim)`` of one activation sharded along ``dim`` alone and replicated
    tokens of fixed counts (learned start, register or memory tokens): None for anything else."""
    sharded = [i for i, t in enumerate(operands) if a.layout(t) != REPLICATE]
    if len(sharded) != 1 or node in a.token_data or not a.context.shard.is_contiguous:
        return None
    index = sharded[0]
    layout = a.layout(operands[index])
    if layout != shard(dim) or a.context.shard.ring_degree != 1:
        return None
    counts = [meta_value(t).shape[dim] for i, t in enumerate(operands) if i != index]
    if not all(isinstance(count, int) for count in counts):
        return None
    return TokenInsertion(dim, index, sum(counts[:index]), sum(counts[index:]))


def _has_no_elements(node: fx.Node) -> bool:
    """Traced with a size 0 that is a number, not a symbol (a sequence length is never 0)."""
    value = meta_value(node)
    return isinstance(value, torch.Tensor) and any(
        isinstance(size, int) and size == 0 for size in value.shape
    )


def _one_piece_holds_every_token(node: fx.Node, dim: int) -> bool:
    """A split at the sequence's end (or start): one piece is the whole sequence, the others are traced
    with a number 0 along it (a length, a symbol, minus itself). Each rank then keeps its whole shard in
    that piece and nothing in the others, which is the global split's shard. transformers' Mamba-2 scans
    (from 5.25) split off the last tokens whose states a cache keeps, none in training."""
    pieces = meta_value(node)
    if not isinstance(pieces, (tuple, list)) or len(pieces) < 2:
        return False
    sizes = [piece.shape[dim] for piece in pieces if isinstance(piece, torch.Tensor)]
    empty = [isinstance(size, int) and size == 0 for size in sizes]
    return len(sizes) == len(pieces) and sum(empty) == len(pieces) - 1


@handles_split
def stack(a, node: fx.Node) -> Layout:
    """stack: a new dim; values split along a dim (a chunked scan's chunks, on the whole sequence for a
    block of channels) stay split along it."""
    tensors = tensor_nodes([arg(node, 0, "tensors")])
    dim = normalize_dims(arg(node, 1, "dim", 0), ndim(node))[0]
    split_side = [t for t in tensors if a.layout(t).is_split]
    if split_side:
        to_out = {d: (d if d < dim else d + 1) for d in range(ndim(node) - 1)}
        joined = align(
            a, [Operand(t, to_out) for t in tensors], to_out[a.layout(split_side[0]).split], ndim(node)
        )
        if joined is not None:
            return joined
        for tensor in split_side:
            a.sequence_home(tensor)
    layouts = [a.layout(t) for t in tensors]
    if all(layout == PARTIAL for layout in layouts):
        return PARTIAL
    for tensor in tensors:
        a.materialize(tensor)
    layouts = [REPLICATE if layout == PARTIAL else layout for layout in layouts]
    if len(set(layouts)) > 1:
        return a.refuse(node, "stacks values of different sequence layouts", "Stack like with like")
    return layouts[0].mapped({d: (d if d < dim else d + 1) for d in range(ndim(node) - 1)})


@dispatch.handles_local_order
@handles_split
def pieces(a, node: fx.Node) -> tuple[Layout, ...]:
    """split / chunk / tensor_split / split_with_sizes / unbind: a tuple of pieces."""
    a.shape_use(*node.args[1:], *node.kwargs.values())
    source, rank = node.args[0], ndim(node.args[0])
    layout = a.layout(source)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    dim_arg = arg(node, 1, "dim", 0) if name == "unbind" else arg(node, 2, "dim", 0)
    dim = normalize_dims(dim_arg, rank)[0]
    count = len(meta_value(node)) if isinstance(meta_value(node), (tuple, list)) else 1
    if layout == PARTIAL:
        return (PARTIAL,) * count
    if layout.is_split and dim == layout.split:
        layout = a.sequence_home(source)
    if layout.kind in ("rows", "inverse") and dim == 0:
        a.refuse(node, f"splits the row dim of {layout}", dispatch.FIX)
        return (layout,) * count
    if dim in layout.dims and not layout.is_split:  # a split value's sequence is whole
        if not _one_piece_holds_every_token(node, dim):
            a.refuse(node, "splits the sequence into pieces", "Split along other dims")
        return (layout,) * count
    if name == "unbind":
        layout = layout.mapped({d: (d if d < dim else d - 1) for d in range(rank) if d != dim})
    return (layout,) * count


# --------------------------------------------------------------------------------------------------
# factories


def factory(a, node: fx.Node) -> Layout:
    """zeros / ones / full / empty / rand* / new_* of a shape: a sequence-sized dim holds one value."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    shape_args = node.args[1:] if name.startswith("new_") else node.args
    if name in ("full", "new_full"):
        shape_args = shape_args[:1]
    a.shape_use(*shape_args, node.kwargs.get("size"))
    return shard(*sequence_dims_of_output(a, node))


@dispatch.handles_local_order
@handles_split
def like(a, node: fx.Node) -> Layout:
    """zeros_like / ones_like / full_like / empty_like / rand_like: the layout of the model tensor."""
    layout = a.layout(node.args[0])
    return REPLICATE if layout == PARTIAL else layout


def arange(a, node: fx.Node) -> Decided:
    a.shape_use(*node.args, *[v for k, v in node.kwargs.items() if k in ("start", "end", "step")])
    row_numbers = dispatch.local_arange(a, node)
    if row_numbers is not None:
        return row_numbers
    values = list(node.args)
    if len(values) == 1:
        values = [0, values[0]]
    start = a.size_expr(values[0] if values else node.kwargs.get("start", 0))
    end = a.size_expr(values[1] if len(values) > 1 else node.kwargs.get("end"))
    step = a.size_expr(values[2] if len(values) > 2 else node.kwargs.get("step", 1))
    # arange(c, T + c) with a constant c: positions shifted by c (1-based positions, a running mean's counts)
    if step != 1 or start is None or not start.is_Integer or end is None or len(symbols.symbols_of(end)) != 1:
        return a.refuse(
            node,
            f"arange({values}) over the sequence length with a step, or a start that is not a constant",
            "Use arange(T) or arange(c, T + c) for positions (the pass makes them this rank's positions)",
        )
    return decide(shard(0), "positions")


def value_of_sizes(a, node: fx.Node) -> Layout:
    """torch.tensor(T), torch.scalar_tensor(T), sym_float(T): a length used as a value (the global one)."""
    return REPLICATE
