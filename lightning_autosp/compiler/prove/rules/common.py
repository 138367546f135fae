"""Helpers the rules share: reading an op's arguments, dims and traced shapes."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import flatten, meta_value
from lightning_autosp.compiler.prove.layout import PARTIAL, REPLICATE, Layout, split

SDPA_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: (
        None
    )
)


def arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    """Argument ``index`` (counting ``self`` of a method as 0, like ``input`` of a torch function)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def tensor_nodes(values: Iterable[object]) -> list[fx.Node]:
    return [
        v for v in flatten(list(values)) if isinstance(v, fx.Node) and isinstance(meta_value(v), torch.Tensor)
    ]


def ndim(node: object) -> int:
    value = meta_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def normalize_dims(dims: object, rank: int) -> list[int]:
    """Dims as non-negative ints; None (all dims) -> every dim."""
    if dims is None:
        return list(range(rank))
    if isinstance(dims, (list, tuple, torch.Size)):
        return [d % max(rank, 1) for d in dims]
    return [int(dims) % max(rank, 1)]


def reduced_positions(rank: int, reduced: Iterable[int], keepdim: bool) -> dict[int, int | None]:
    """Where each dim goes after reducing ``reduced`` (None: gone, or kept with size 1, which no token
    indexes any more)."""
    reduced = set(reduced)
    if keepdim:
        return {d: None if d in reduced else d for d in range(rank)}
    where, next_dim = {}, 0
    for d in range(rank):
        if d in reduced:
            where[d] = None
        else:
            where[d], next_dim = next_dim, next_dim + 1
    return where


ATTENTION_FIX = (
    "Compute attention with torch.nn.functional.scaled_dot_product_attention (HF: "
    "attn_implementation='sdpa') "
    "or flash-attn's flash_attn_func, which the SP pass rewrites"
)


def materialize_all(a, node: fx.Node) -> list[Layout]:
    tensors = tensor_nodes([*node.args, *node.kwargs.values()])
    for tensor in tensors:
        a.materialize(tensor)
    return [REPLICATE if a.layout(t) == PARTIAL else a.layout(t) for t in tensors]


def no_split_fix(a, source: fx.Node, fix: str) -> str:
    """The fix of an op on the sequence that no dim of ``source`` could be split over."""
    if a.layout(source).flat:
        return (
            f"{fix} (its tokens are flattened together with the batch, so it cannot run on the whole "
            "sequence for a block of another dim: keep the [B, S, ...] dims apart for this op)"
        )
    sizes = [int(size) if not a.has_sequence_symbol(size) else "S" for size in a.shape(source) or ()]
    return (
        f"{fix} (no dim it treats independently, of sizes {sizes}, divides by sp_size="
        f"{a.context.shard.world}, which would let it run on the whole sequence for a block of that dim)"
    )


INDEX_FIX = "Index along the sequence in the data pipeline, or keep the op per token"


def sequence_dims_of_output(a, node: fx.Node) -> set[int]:
    """Dims of ``node``'s traced shape whose size is a sequence length (factories, expand)."""
    shape = a.shape(node) or ()
    return {d for d, expr in enumerate(shape) if a.has_sequence_symbol(expr)}


def partial_passes(a, node: fx.Node) -> Layout | None:
    """Views, slices and selections are linear: a partial sum stays one."""
    return PARTIAL if a.layout(node.args[0]) == PARTIAL else None


def holds_tokens(a, expr: object) -> bool:
    """Whether a dim of traced size ``expr`` can hold this rank's part of a sequence: a whole multiple of
    one length plus a constant the multiple divides (``preconditions.shape_part``), not a size of chunks
    or of a chunk (a floor division of the length)."""
    (symbol,) = symbols.symbols_of(expr) & set(a.lengths) or {None}
    scale, rest = symbols.affine(expr, symbol) if symbol is not None else (None, 0)
    return bool(scale) and rest % scale == 0


def restore_sequence_dims(a, node: fx.Node, layout: Layout) -> Layout:
    """``layout`` of a value on the whole sequence (split), with every dim as long as the sequence counted
    among its sequence dims: its row t is position t, which is all a sequence dim's layout says (Note
    [Sequence layouts]), so it can go back to sequence shards (a chunked scan's output cut back to the
    length, ``y[:, :S]``)."""
    restored = {d for d, size in enumerate(a.shape(node) or ()) if size in a.lengths} - {layout.split}
    if not layout.is_split or restored <= set(layout.dims):
        return layout
    return split(layout.split, *(set(layout.dims) | restored), flat=layout.flat, chunks=layout.chunks)
