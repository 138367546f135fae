"""The rule for views (view, reshape, flatten, unflatten, squeeze, unsqueeze).

A view that keeps the sequence dim, or flattens it with other dims and keeps every token's elements in
place, propagates; one that cuts it into chunks runs on the whole sequence (Note [Redistribution]).

Note [Views of flattened tokens]
    A view that flattens the sequence with other dims (``[B, S, H, D] -> [B * S * H, D]``, a gated norm
    over every head's row) leaves each token's elements where they were in the element order: outer dims
    before it (B), inner after it (H). On a rank that order holds too, over its own tokens, so a view of
    a sequence dim is exact exactly when it keeps the counts of elements before and after the tokens:
    ``[B * S * H, D] -> [B, S, H * D]`` does (2 before, 32 after), ``-> [H, S, B * D]`` would not. A flat
    dim's size alone (8 * S) does not say how it splits into outer and inner, so the view that flattens
    records the inner count in the layout (``Layout.flat_inner``) for the view that un-flattens, and
    elementwise ops carry it (and refuse to combine two values flattened with different inner counts,
    whose elements at the same index are different tokens' on a rank). A flat dim whose count is
    unknown (from another rule) still only un-flattens into its outer dims.

    A sequence sliced to a fixed number of tokens (``ids[:, -4096:]``) has no length symbol to mark the
    dim its tokens go to, so the counts find it: the output dim with the same elements before and after
    the tokens. Each rank holds another number of those tokens, so only a view that lets every rank infer
    that dim's size (-1, or no sizes at all) is exact.
"""

from __future__ import annotations

import math

import sympy
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import flatten, meta_value
from lightning_autosp.compiler.prove.layout import REPLICATE, Layout, split
from lightning_autosp.compiler.prove.plan import Decided, decide
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import holds_tokens, partial_passes
from lightning_autosp.compiler.prove.rules.split import handles_split, split_along


@dispatch.handles_local_order
@handles_split
def view(a, node: fx.Node) -> Decided:
    """view / reshape / flatten / unflatten / squeeze / unsqueeze / view_as / reshape_as."""
    a.shape_use(*node.args[1:], *node.kwargs.values())
    partial = partial_passes(a, node)
    if partial:
        return partial
    source = node.args[0]
    layout = a.layout(source)
    in_shape, out_shape = a.shape(source), a.shape(node)
    if layout.kind in ("rows", "inverse"):
        return keeps_rows(a, node, source, layout)
    if in_shape is None or out_shape is None or layout.kind not in ("shard", "global", "split"):
        return layout
    # a mask handed on whole: its sizes are the global ones
    rewrites = ("global_shapes",) if layout.kind == "global" else ()
    hints_in = [symbols.hint(v) for v in meta_value(source).shape]
    hints_out = [symbols.hint(v) for v in meta_value(node).shape]
    groups = _view_groups(hints_in, hints_out)
    split_dim = None
    if layout.is_split:
        split_dim = _split_through_view(a, layout.split, groups, hints_in, hints_out, layout.dims)
        if split_dim is None:  # its block is not one block of the new shape: back to sequence shards
            a.sequence_home(source)
            return view(a, node)
    if split_dim is not None:  # the sequence is whole: views may cut it into chunks and join them
        out = _split_view(a, layout, split_dim, groups, hints_in, out_shape)
        if out.flat and not layout.flat and _flattens_after_others(layout, groups, hints_in):
            # tokens flattened with the batch on the whole sequence could not go back to shards later
            # (the loss's [B * S, V] logits): they go back first, and are flattened as this rank's
            a.sequence_home(source)
            return view(a, node)
        return decide(out, "split_shapes")
    dims, flat, inner = set(), set(), {}
    for group_in, group_out in groups:
        seq_in = [d for d in group_in if d in layout.dims]
        if not seq_in:
            continue
        carriers = [d for d in group_out if a.has_sequence_symbol(out_shape[d])]
        fixed = None
        if not carriers and len(seq_in) == 1 and not a.has_sequence_symbol(in_shape[seq_in[0]]):
            groups_here = (group_in, group_out)
            fixed = _fixed_tokens_through_view(node, layout, seq_in[0], *groups_here, in_shape, out_shape)
            carriers = [fixed[0]] if fixed is not None else carriers
        merged = len(group_in) > 1 and any(hints_in[d] != 1 for d in group_in if d not in seq_in)
        # Size-1 dims join the run before them (``_view_groups``) but hold no elements: a run
        # (s, 1) -> (s, 1) keeps the sequence whole (multi-head attention at batch size 1).
        sized_in = [d for d in group_in if hints_in[d] != 1 or d in seq_in]
        sized_out = [d for d in group_out if hints_out[d] != 1 or d in carriers]
        # a carrier sized as chunks of the length (one chunk at this length) holds no rank's part of it
        chunked = fixed is None and any(not holds_tokens(a, out_shape[d]) for d in carriers)
        through = fixed[1:] if fixed is not None else None
        if fixed is None and len(seq_in) == 1 and len(carriers) == 1 and not chunked:
            through = _tokens_through_view(
                a, layout, seq_in[0], carriers[0], group_in, group_out, in_shape, out_shape
            )
        unflattens = len(sized_in) > 1 and len(sized_out) > 1
        if len(seq_in) > 1 or len(carriers) != 1 or (unflattens and through is None) or chunked:
            # (not where this rule just brought the source back from a block: that would go round)
            if not a.moved(source) and _whole_sequence_for_a_block(a, node, source, layout, groups):
                return view(a, node)
            return a.refuse(
                node,
                f"reshapes the sequence dim {seq_in} of {tuple(in_shape)} into {tuple(out_shape)} in "
                "a way that mixes it with another dim",
                "Keep the sequence dim whole in views (flattening it with the dims before it is fine)",
            )
        (out_dim,) = carriers
        dims.add(out_dim)
        if through is not None:  # Note [Views of flattened tokens]
            outer, each = through
            if outer * each > 1:
                flat.add(out_dim)
                inner[out_dim] = each
        elif merged or any(d in layout.flat for d in seq_in) and len(group_out) == 1:
            flat.add(out_dim)
    if not dims:
        return decide(REPLICATE, *rewrites)
    flat_inner = tuple(sorted(inner.items()))
    return decide(
        Layout(layout.kind, tuple(sorted(dims)), tuple(sorted(flat)), flat_inner=flat_inner), *rewrites
    )


def _tokens_through_view(
    a, layout: Layout, seq: int, carrier: int, group_in: list[int], group_out: list[int], in_shape, out_shape
) -> tuple[int, int] | None:
    """Note [Views of flattened tokens]: (outer, inner) of the dim ``carrier`` a view makes of the sequence
    dim ``seq`` (its size is outer * L * inner, tokens in the middle), or None where that is unknown."""
    symbol = _length_symbol(a, in_shape[seq])
    if symbol is None or symbol != _length_symbol(a, out_shape[carrier]):
        return None
    k_in, rest_in = symbols.affine(in_shape[seq], symbol)
    k_out, rest_out = symbols.affine(out_shape[carrier], symbol)
    others = [in_shape[d] for d in group_in if d != seq] + [out_shape[d] for d in group_out if d != carrier]
    if not k_in or not k_out or rest_in or rest_out or not all(isinstance(n, sympy.Integer) for n in others):
        return None
    if seq in layout.flat:
        each_in = dict(layout.flat_inner).get(seq)
        if each_in is None:  # flattened by a rule that did not say how
            return None
    elif k_in == 1:
        each_in = 1
    else:
        return None

    after_in = each_in * _product(in_shape, group_in[group_in.index(seq) + 1 :])
    after_out = _product(out_shape, group_out[group_out.index(carrier) + 1 :])
    if after_in % after_out:
        return None
    each_out = after_in // after_out
    if k_out % each_out:
        return None
    return k_out // each_out, each_out


def _fixed_tokens_through_view(
    node: fx.Node, layout: Layout, seq: int, group_in: list[int], group_out: list[int], in_shape, out_shape
) -> tuple[int, int, int] | None:
    """Note [Views of flattened tokens] for a sequence sliced to a fixed number of tokens (``ids[:, -N:]``),
    which no length symbol marks: (the dim that holds the tokens, outer, inner), found by counting the
    elements before and after them. None where a count is unknown (a flat dim), the tokens are one (any
    size-1 dim could hold it), or the view names the size of the dim that holds them (a rank holds
    another number of those tokens: only -1 lets each rank's view infer its own)."""
    sizes = [*in_shape, *out_shape]
    if seq in layout.flat or not all(isinstance(size, sympy.Integer) for size in sizes):
        return None
    tokens, at = int(in_shape[seq]), group_in.index(seq)
    before, after = _product(in_shape, group_in[:at]), _product(in_shape, group_in[at + 1 :])
    for position, carrier in enumerate(group_out):
        before_out = _product(out_shape, group_out[:position])
        after_out = _product(out_shape, group_out[position + 1 :])
        if tokens < 2 or before % before_out or after % after_out:
            continue
        outer, each = before // before_out, after // after_out
        if outer * tokens * each == int(out_shape[carrier]):
            return (carrier, outer, each) if _size_inferred(node, carrier, len(out_shape)) else None
    return None


def _size_inferred(node: fx.Node, dim: int, rank: int) -> bool:
    """Whether each rank's view infers the size of output dim ``dim`` (-1, or a view with no sizes)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in ("flatten", "ravel", "squeeze", "unsqueeze", "view_as", "reshape_as"):
        return True
    sizes = flatten([*node.args[1:], *node.kwargs.values()])
    return name in ("view", "reshape") and len(sizes) == rank and sizes[dim] == -1


def _product(shape, dims: list[int]) -> int:
    return math.prod(int(shape[d]) for d in dims)


def _length_symbol(a, size: object) -> sympy.Symbol | None:
    found = symbols.symbols_of(size) & set(a.lengths)
    return next(iter(found)) if len(found) == 1 else None


def _flattens_after_others(layout: Layout, groups: list, hints_in: list[int]) -> bool:
    """Whether a view flattens a token dim with dims before it only (``[B, S, V] -> [B * S, V]``), as
    sequence shards are flattened too."""
    for group_in, _ in groups:
        tokens = [d for d in group_in if d in layout.dims]
        sized = [d for d in group_in if hints_in[d] != 1 or d in tokens]
        if len(tokens) == 1 and len(sized) > 1 and sized[-1] == tokens[0]:
            return True
    return False


def _split_view(a, layout: Layout, split_dim: int, groups: list, hints_in: list[int], out_shape) -> Layout:
    """Where the tokens go through a view of a split value: a token dim kept (or flattened with the dims
    before it), cut into (chunk, position in chunk) dims, or such a pair joined back into one."""
    dims, flat, chunks = set(), set(), set()
    pairs = {pair: pair for pair in layout.chunks}
    for group_in, group_out in groups:
        tokens_in = [d for d in group_in if d in layout.dims]
        carriers = [d for d in group_out if a.has_sequence_symbol(out_shape[d])]
        joined = [pair for pair in pairs if set(pair) <= set(group_in)]
        if tokens_in and len(carriers) == 1:
            dims.add(carriers[0])
            # a dim exactly as long as the sequence is one whichever dims made it (the halves of a scan
            # interleaved): the value is whole, so its row t is the single-device value's row t
            others = any(hints_in[d] != 1 for d in group_in if d not in tokens_in)
            if len(group_in) > 1 and others and out_shape[carriers[0]] not in a.lengths:
                flat.add(carriers[0])
        elif len(tokens_in) == 1 and len(group_in) == 1 and carriers == group_out and len(carriers) == 2:
            chunks.add(tuple(carriers))
        elif joined and len(carriers) == 1 and set(group_in) == set(joined[0]):
            dims.add(carriers[0])
    return split(split_dim, *sorted(dims), flat=tuple(sorted(flat)), chunks=tuple(sorted(chunks)))


def _whole_sequence_for_a_block(a, node: fx.Node, source: fx.Node, layout: Layout, groups: list) -> bool:
    """A view that cuts the sequence into chunks (chunked linear attention, Mamba's scan) is a plain view of
    the whole sequence: move the source there, for a block of a dim the view keeps apart (its heads)."""
    if layout.kind != "shard" or source in a.token_data:
        return False
    kept = [group_in[0] for group_in, group_out in groups if len(group_in) == 1 and len(group_out) == 1]
    candidates = [d for d in kept if d not in layout.dims]
    ordered = [d for d in candidates if d != 0] + [d for d in candidates if d == 0]
    return any(split_along(a, source, dim) for dim in ordered)


def keeps_rows(a, node: fx.Node, source: fx.Node, layout: Layout) -> Layout:
    """A view or expand of a mixture of experts' rows keeps them if dim 0 stays as it is."""
    before, after = meta_value(source).shape, meta_value(node).shape
    if len(after) == 0 or len(before) == 0 or str(before[0]) != str(after[0]):
        return a.refuse(node, f"reshapes the row dim of {layout}", dispatch.FIX)
    return layout


def _split_through_view(
    a, dim: int, groups: list, hints_in: list[int], hints_out: list[int], sequence: tuple[int, ...]
) -> int | None:
    """Where a split dim goes through a view: its blocks stay blocks when it is the outermost dim (of
    size > 1) of its group and the outermost dim of the group's output cuts into P blocks too."""
    for group_in, group_out in groups:
        if dim not in group_in:
            continue
        outer_in = [d for d in group_in if hints_in[d] != 1]
        outer_out = [d for d in group_out if hints_out[d] != 1]
        if any(d in sequence for d in group_in) or not outer_in or outer_in[0] != dim or not outer_out:
            return None
        return outer_out[0] if hints_out[outer_out[0]] % a.context.shard.world == 0 else None
    return None


def _view_groups(shape_in: list[int], shape_out: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dims with equal products (size-1 dims join the run before them)."""
    groups, i, j = [], 0, 0
    while i < len(shape_in) or j < len(shape_out):
        group_in, group_out, size_in, size_out = [], [], 1, 1
        while True:
            if (size_in <= size_out or j >= len(shape_out)) and i < len(shape_in):
                size_in *= shape_in[i]
                group_in.append(i)
                i += 1
            elif j < len(shape_out):
                size_out *= shape_out[j]
                group_out.append(j)
                j += 1
            else:
                break
            if size_in == size_out:
                while i < len(shape_in) and shape_in[i] == 1:
                    group_in.append(i)
                    i += 1
                while j < len(shape_out) and shape_out[j] == 1:
                    group_out.append(j)
                    j += 1
                break
        groups.append((group_in, group_out))
    return groups
