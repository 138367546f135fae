"""Helpers the rules share: reading an op's arguments, dims and traced shapes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

from lightning_autosp.compiler.fx_utils import flatten, meta_value


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
