"""How an op runs on the whole sequence for a block of another dim (Note [Redistribution]).

An op that mixes tokens (attention written out, a running sum, a flip, a depthwise convolution) but
treats some dim ``k`` (heads, channels) independently is exact on ``split(k)`` values: every rank holds
all S tokens of 1/P of dim k. ``align`` states the layout each operand must have for the op to run so
(an all-to-all for this rank's tokens of an activation, the whole sequence for token data, this rank's
block for a replicated operand such as a per-head bias) and returns the output layout; ``choose`` picks
``k`` for an op whose operands are still sequence shards.

Operands are described by ``Operand(node, to_out)``: ``to_out[d]`` is the output dim that dim ``d`` of
the operand lines up with (None: contracted or reduced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import meta_value
from lightning_autosp.compiler.prove.layout import PARTIAL, REPLICATE, Layout, global_, split

Rule = Callable[..., object]


def handles_split(rule: Rule) -> Rule:
    """Mark a rule that takes split inputs; other rules get them back in sequence shards first."""
    rule.handles_split = True
    return rule


@dataclass(frozen=True)
class Operand:
    node: fx.Node
    to_out: dict[int, int | None]

    def dim_for(self, out_dim: int) -> int | None:
        return next((d for d, o in self.to_out.items() if o == out_dim), None)


def broadcast(node: fx.Node, out_rank: int) -> Operand:
    """An operand of an elementwise op: its dims line up with the output's from the right."""
    rank = _rank(node)
    return Operand(node, {d: d + out_rank - rank for d in range(rank)})


def sizes(node: fx.Node) -> list[int]:
    value = meta_value(node)
    return [symbols.hint(s) or 0 for s in value.shape] if isinstance(value, torch.Tensor) else []


def _rank(node: object) -> int:
    value = meta_value(node)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _splittable(a, node: fx.Node, dim: int | None) -> bool:
    """Whether dim ``dim`` of ``node`` can be cut in P equal blocks (a number, not a length)."""
    if dim is None:
        return False
    shape = a.shape(node)
    if shape is None or a.has_sequence_symbol(shape[dim]):
        return False
    return int(shape[dim]) % a.context.shard.world == 0


def _target(a, operand: Operand, out_dim: int) -> Layout | None | bool:
    """The layout ``operand`` must have for an output split along ``out_dim``: a Layout to move to,
    True if it is fine as it is, None if no move gets it there."""
    node = operand.node
    layout = a.layout(node)
    dim = operand.dim_for(out_dim)
    size = sizes(node)[dim] if dim is not None else 1
    if layout.is_split:
        return True if layout.split == dim else None
    if layout == PARTIAL:  # align all-reduces it first
        layout = REPLICATE
    if layout.kind == "shard":
        if node in a.token_data:  # masks, positions: recomputed whole (and this rank's block)
            return split(dim, *layout.dims) if size != 1 else global_(*layout.dims)
        if (
            len(layout.dims) == 1
            and not layout.flat
            and _splittable(a, node, dim)
            and a.context.shard.is_contiguous
        ):
            return split(dim, *layout.dims)
        return None
    if layout.kind in ("replicate", "global"):
        return split(dim, *layout.dims) if size != 1 and _splittable(a, node, dim) else (size == 1 or None)
    return None


def align(a, operands: Sequence[Operand], out_dim: int, out_rank: int) -> Layout | None:
    """Move every operand to the layout an output split along ``out_dim`` needs; None (nothing moved)
    if some operand cannot get there."""
    targets = [_target(a, operand, out_dim) for operand in operands]
    if any(target is None for target in targets):
        return None
    sequence, flat = set(), set()
    for operand, target in zip(operands, targets):
        a.materialize(operand.node)
        if isinstance(target, Layout):
            a.need(operand.node, target)
        layout = a.layout(operand.node)
        sequence |= {operand.to_out[d] for d in layout.dims if operand.to_out.get(d) is not None}
        flat |= {operand.to_out[d] for d in layout.flat if operand.to_out.get(d) is not None}
    if out_dim in sequence or not 0 <= out_dim < out_rank:
        return None
    return split(out_dim, *sorted(sequence), flat=tuple(sorted(flat & sequence)))


def choose(a, operands: Sequence[Operand], candidates: Sequence[int]) -> int | None:
    """The output dim to split an op over: one an operand is split along already, else the first
    candidate (batch last) every operand can be cut along."""
    for operand in operands:
        layout = a.layout(operand.node)
        if layout.is_split and operand.to_out.get(layout.split) in candidates:
            return operand.to_out[layout.split]
    ordered = [d for d in candidates if d != 0] + [d for d in candidates if d == 0]
    for out_dim in ordered:
        if all(_target(a, operand, out_dim) is not None for operand in operands):
            return out_dim
    return None


def split_along(a, node: fx.Node, dim: int) -> bool:
    """Move ``node`` itself to the whole sequence for a block of its dim ``dim``, if it can go there."""
    target = _target(a, Operand(node, {d: d for d in range(_rank(node))}), dim)
    if not isinstance(target, Layout) or not target.is_split or node in a.token_data:
        return False
    a.need(node, target)
    return True


def to_whole_sequence(a, node: fx.Node, keep: Sequence[int] = ()) -> bool:
    """Move a sequence shard to the whole sequence for a block of one of its other dims (not ``keep``; the
    batch last), for an op that reads it along the sequence; whether it could go."""
    layout = a.layout(node)
    if layout.kind != "shard" or node in a.token_data:
        return False
    candidates = [d for d in range(_rank(node)) if d not in layout.dims and d not in keep]
    return any(
        split_along(a, node, d) for d in [d for d in candidates if d != 0] + [d for d in candidates if d == 0]
    )


def split_operands(a, operands: Sequence[Operand]) -> list[Operand]:
    return [operand for operand in operands if a.layout(operand.node).is_split]


def home_or_align(a, operands: Sequence[Operand], out_rank: int) -> Layout | None:
    """An op that works token by token on a mix of split values and sequence shards: the cheaper side
    moves (DTensor picks the cheapest strategy too). On a tie the split side goes back to sequence
    shards, the layout every rule reads: a residual stream kept split after a scan stayed split along
    the hidden dim, where an indexed write into it (rotary sections) could not be done on this rank's
    part. Returns the output layout if it stays split, None once every operand is back in sequence
    shards."""
    split_side = split_operands(a, operands)
    if not split_side:
        return None
    shard_side = [op for op in operands if a.layout(op.node).kind == "shard" and op.node not in a.token_data]
    out_dim = split_side[0].to_out.get(a.layout(split_side[0].node).split)
    if out_dim is not None and _bytes(split_side) > _bytes(shard_side):
        layout = align(a, operands, out_dim, out_rank)
        if layout is not None:
            return layout
    for operand in split_side:
        a.sequence_home(operand.node)
    return None


def _bytes(operands: Sequence[Operand]) -> int:
    total = 0
    for operand in operands:
        value = meta_value(operand.node)
        if isinstance(value, torch.Tensor):
            count = 1
            for size in sizes(operand.node):
                count *= size
            total += count * value.element_size()
    return total
