"""What lowering needs beyond each op's rule, checked when the analysis ends, before anything is rewritten.

Note [Refusals before rewriting]
    A rule sees one op. Some of what lowering needs is known only once every value has its layout (which sizes
    end up as shapes of this rank's values) or concerns the run as a whole (the heads against the Ulysses
    degree, the ring's token layout, the shard lengths against a convolution's window). These are checked
    here, right after each ``Analysis.run`` (``sp_pass.py``), so that every refusal and configuration error of
    a graph comes from the analysis, on every rank alike, before the first rewrite; the plans compared for a
    graph with convolutions (Note [Windows or blocks] in ``sp_pass.py``) see them too, and a windowed plan
    that would leave a rank without output positions loses to the plan on blocks of groups. Lowering raises
    nothing: what it could not do is an internal error, not a refusal.
"""

from __future__ import annotations

import sympy
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import ancestors, bind, example_value, flatten
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.plan import AttentionCall
from lightning_autosp.compiler.prove.rules.products import conv_signature
from lightning_autosp.data import SequenceShard


def check_lowering(a: Analysis) -> None:
    """Record, on ``a``, what lowering of its plan would not be able to do (Note [Refusals before
    rewriting])."""
    _attention_heads(a)
    _masks_from_token_inputs(a)
    _shapes_of_lengths(a)
    _convolution_windows(a)


# --------------------------------------------------------------------------------------------------
# attention


def heads_error(shard: SequenceShard, heads: int, name: str) -> str:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    if shard.ring_degree == 1:
        return (
            f"sp_size={shard.world} must divide the number of attention heads ({heads}) of {name}; "
            f"use one of {divisors}, or AutoSPStrategy(ulysses_degree='auto') to run the rest of sp as "
            "ring attention."
        )
    usable = [d for d in divisors if shard.world % d == 0]
    return (
        f"ulysses_degree={shard.ulysses_degree} must divide the number of attention heads ({heads}) of "
        f"{name}; use ulysses_degree='auto' or one of {usable}."
    )


def _attention_heads(a: Analysis) -> None:
    """The heads split over the Ulysses degree: a configuration error, named with the sizes that work."""
    shard = a.context.shard
    for node, call in a.plan.attention.items():
        if isinstance(call, AttentionCall):
            if call.heads % shard.ulysses_degree:
                a.errors.append(heads_error(shard, call.heads, node.name))
            continue
        heads = example_value(call.operands["q"]).shape[call.head_dim]
        if heads % shard.world:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            a.errors.append(
                f"sp_size={shard.world} must divide the number of attention heads ({heads}) of {call.name}; "
                f"use one of {divisors}."
            )


def _masks_from_token_inputs(a: Analysis) -> None:
    """A mask computed from per-token inputs (packed documents) is rebuilt from the gathered inputs in
    sequence order, which the zigzag ring layout does not give yet."""
    if a.context.shard.is_contiguous:
        return
    for node, call in a.plan.attention.items():
        mask = call.mask if isinstance(call, AttentionCall) else None
        if isinstance(mask, fx.Node) and _reads_sharded_inputs(a, mask):
            a.refuse(
                node,
                "its attention mask is computed from per-token data (packed documents), which is not "
                "supported with ring_layout='zigzag' yet",
                "Use AutoSPStrategy(ring_layout='contiguous')",
            )


def _reads_sharded_inputs(a: Analysis, node: fx.Node) -> bool:
    return any(n.op == "placeholder" and a.layout(n).is_shard for n in ancestors(node))


# --------------------------------------------------------------------------------------------------
# sizes


def shape_part(a: Analysis, expr: sympy.Expr) -> tuple[sympy.Symbol | None, int | None, int]:
    """A size used as a shape, as (length symbol, a, c) with ``expr == a * (symbol + c / a)``: this rank's
    part of it is ``a`` times its count of a length ``symbol + c / a`` (``positions.lengths_pass``);
    ``a`` is None when no rank can tell its part."""
    (symbol,) = symbols.symbols_of(expr) & set(a.lengths) or {None}
    scale, rest = symbols.affine(expr, symbol)
    if scale is None or (scale and rest % scale):
        return symbol, None, 0
    return symbol, scale, rest


def _computed_anew(a: Analysis) -> set[fx.Node]:
    """Nodes whose value lowering computes anew (token data for the whole sequence, positions, the masks
    attention gets whole) and the nodes only they read: these go dead, and their sizes never become
    shapes of this rank's values."""
    anew = {*a.plan.recompute, *a.plan.positions, *a.plan.tables}
    # users that get a value computed whole for them (a mask for attention, token data moved to global)
    # read the copy, not the value
    elsewhere = {
        (call.mask, node)
        for node, call in a.plan.attention.items()
        if isinstance(call, AttentionCall) and isinstance(call.mask, fx.Node)
    }
    elsewhere |= {(move.value, move.user) for move in a.plan.redistributions if move.via == "recompute"}
    for node in reversed(a.gm.graph.nodes):
        if node not in anew and node.users and all(u in anew or (node, u) in elsewhere for u in node.users):
            anew.add(node)
    return anew


def _shapes_of_lengths(a: Analysis) -> None:
    """Every size computed from the length that an op takes as a shape of this rank's values must be a
    multiple of a length, so that each rank can tell its part of it."""
    # what lowering computes anew, rewrites with its own sizes (slices, selections, attention), sizes at S
    # (global_shapes), and the arithmetic on lengths itself, whose users get the number it computes
    skipped = _computed_anew(a) | {*a.plan.slices, *a.plan.selections, *a.plan.attention}
    skipped |= {*a.plan.global_shapes, *a.sizes}
    values = set(a.plan.value_sizes)
    for node in a.gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or node in skipped:
            continue
        for arg in _size_args(a, node):
            if (node, arg) in values:
                continue
            for expr in a.sizes[arg] if isinstance(a.sizes[arg], tuple) else (a.sizes[arg],):
                if shape_part(a, expr)[1] is None:
                    a.refuse(
                        node,
                        f"takes a shape {expr} computed from the sequence length that is not a multiple of a "
                        "length (a * (S + c)), so no rank can tell its part of it",
                        "Derive it from a shape the sequence gives (-1 in views and reshapes)",
                    )
                    return


def _size_args(a: Analysis, node: fx.Node) -> list[fx.Node]:
    leaves = flatten([node.args, node.kwargs])
    return list(dict.fromkeys(x for x in leaves if isinstance(x, fx.Node) and x in a.sizes))


def _convolution_windows(a: Analysis) -> None:
    """A convolution on windows gives each rank the output positions it owns: every rank must own some."""
    for node, window in a.plan.windows.items():
        source = bind(node, conv_signature(node))["input"]
        length = a.global_value(a.shape(source)[window.dim])
        out_length = window.output_length(length)
        empty = [
            rank
            for rank, (first, stop) in enumerate(a.context.shard.owned_ranges(out_length))
            if stop <= first
        ]
        if empty:
            a.refuse(
                node,
                f"the convolution's {out_length} output positions leave rank {empty[0]} none",
                "Use longer sequences or a smaller sp_size",
            )
