"""Sequence lengths as symbols: where every size of a graph comes from.

Note [Symbolic sequence lengths]
    The strategy marks the sequence dim of every sharded batch tensor dynamic
    (``torch._dynamo.maybe_mark_dynamic``), so Dynamo traces a rank's step with its shard length as a
    symbol, say ``s0``, instead of a number. Every size computed from it is an expression in ``s0``
    (``s0 - 1`` after a shift, ``2*s0`` after flattening a batch of 2), and a window of 4096, a head
    dim or a vocabulary that happens to equal the shard length stays a plain number. So the SP pass
    never decides by value which sizes are sequence lengths.

    The trace is valid for every length that satisfies the shape guards Dynamo recorded (the Python
    branches the model took on the length). Evaluated at the global length, the same graph is the
    single-device program, if those guards hold there too: ``check_guards_at_global_length`` refuses
    a model whose branches differ between the shard and the whole sequence (a sliding window taken
    only when the length exceeds it, ``int(x.size(1))`` turned into a constant).

    Once the pass has read the graph, ``specialize`` fixes the symbol to this rank's length: the rest of
    compilation (AOTAutograd, Inductor) sees static shapes, and Dynamo guards the compiled frame on
    the length. Sizes are read from the *unsimplified* expressions (``SymNode._expr``), which later
    sub-graphs of the same trace (DDP's buckets) still carry after that specialization.

Only this module touches torch's private symbolic-shape API, so a torch upgrade changes one file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_int


def raw_expr(size: object) -> sympy.Expr | None:
    """The expression of an int or SymInt as traced (before any later specialization), else None."""
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return sympy.Integer(size)
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node._expr)
    return None


def shape_exprs(value: torch.Tensor) -> tuple[sympy.Expr, ...]:
    return tuple(raw_expr(size) for size in value.shape)


def symbols_of(expr: sympy.Basic | None) -> set[sympy.Symbol]:
    """The free symbols of a size (an ``Expr``) or a guard (a ``Boolean``)."""
    return set(expr.free_symbols) if isinstance(expr, sympy.Basic) else set()


def evaluate(expr: sympy.Expr, lengths: Mapping[sympy.Symbol, int]) -> int:
    """``expr`` with every sequence symbol replaced by a length."""
    value = expr.subs(dict(lengths))
    if not value.is_number:
        raise ValueError(f"size {expr} depends on symbols other than the sequence lengths {list(lengths)}")
    return int(value)


def shape_env_of(example_inputs: Sequence[object]) -> object | None:
    for value in example_inputs:
        mode = getattr(value, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return mode.shape_env
    context = torch._guards.TracingContext.try_get()
    mode = getattr(context, "fake_mode", None)
    return getattr(mode, "shape_env", None)


def graph_shape_env(gm: fx.GraphModule, example_inputs: Sequence[object]) -> object | None:
    """The ShapeEnv Dynamo traced ``gm`` with (its symbols live there)."""
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            return value.node.shape_env
        mode = getattr(value, "fake_mode", None)
        if isinstance(value, torch.Tensor) and mode is not None and mode.shape_env is not None:
            return mode.shape_env
    return shape_env_of(example_inputs)


def guard_count(shape_env: object) -> int:
    return len(getattr(shape_env, "guards", ()))


def broken_guards(
    shape_env: object, lengths: Mapping[sympy.Symbol, int], first: int | None = None
) -> list[tuple[str, str]]:
    """The shape guards on the sequence symbols that do not hold at the global lengths, as
    ``(guard, where the user's code took the branch)``; the first ``first`` guards only (those Dynamo
    recorded while tracing, not any the compiler adds afterwards)."""
    broken = []
    for guard in list(getattr(shape_env, "guards", ()))[:first]:
        expr = guard.expr
        if not symbols_of(expr) or not symbols_of(expr) <= set(lengths):
            continue
        try:
            holds = bool(expr.subs(dict(lengths)))
        except TypeError:  # not decidable: treat as broken, the branch depends on the length
            holds = False
        if not holds:
            broken.append((str(expr), guard.sloc.maybe_user_loc or str(guard.sloc)))
    return broken


def specialize(size: torch.SymInt) -> int:
    """Fix the symbol of ``size`` (a bare sequence symbol) to its traced value (Note [Symbolic sequence
    lengths]); Dynamo guards the compiled frame on it."""
    return guard_int(size)


def hint(size: object) -> int | None:
    """The value an int or SymInt had when traced."""
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return None
