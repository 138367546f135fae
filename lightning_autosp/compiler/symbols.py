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

    Once the pass has read the graph, it keeps the symbol where it can (Note [One graph for every
    length]): the rewrites' sizes become expressions of it and the rest of compilation (AOTAutograd,
    Inductor) compiles with dynamic shapes, so one graph serves every length of its class. Where it
    cannot (ring layouts, whose chunks are whole numbers per length), ``specialize`` fixes the symbol to
    this rank's length and Dynamo guards the compiled frame on it. Sizes are read from the
    *unsimplified* expressions (``SymNode._expr``), which later sub-graphs of the same trace (DDP's
    buckets) still carry after a specialization.

Only this module touches torch's private symbolic-shape API, so a torch upgrade changes one file.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod


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


def concrete(size: object) -> int:
    """An int's or SymInt's value in this trace, without guarding on it: for estimates (bytes, FLOPs)
    that must not fix a sequence symbol (Note [One graph for every length])."""
    if isinstance(size, torch.SymInt):
        node = size.node
        return int(node.hint) if node.hint is not None else int(node.shape_env.size_hint(node.expr))
    return int(size)


def specialize_symbol(shape_env: object, symbol: sympy.Symbol) -> int:
    """Fix ``symbol`` to the value it was traced at (a guard); returns it."""
    value = int(shape_env.var_to_val[symbol])
    return guard_int(shape_env.create_symintnode(symbol, hint=value))


def hint(size: object) -> int | None:
    """The value an int or SymInt had when traced."""
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.hint
    return None


# Note [One graph for every length]
#     A contiguous balanced layout of P ranks splits a global length G into ``q = G // P`` tokens per rank
#     plus one for each of the first ``m = G % P`` ranks. For a fixed ``m`` (the layout's length class),
#     rank r's traced shard symbol s is ``q + [r < m]``, so G and every rank's length are affine in s:
#     ``G = P * (s - [r < m]) + m``. The rewrites then compute their sizes (all-to-all splits, position
#     offsets, slice and halo bounds, global counts) as SymInts in s, and the graph serves every length
#     of the class: Dynamo guards the frame on each branch a rewrite takes (``min`` of two bounds, a halo
#     reaching the next rank) and on the model's own branches evaluated at G (``guard_at_global``).
#     A length of another class (G % P differs) is another region with its own graph (steps.py), so
#     sp=2 compiles a step at most twice for any mix of lengths; a collator's ``pad_to_multiple_of=P``
#     makes it once. Anything that still turns a size into a number while compiling (``int()``, a
#     ``range`` over a length) fixes the symbol with a guard: correct, and reported by the backend
#     (``share_length_guards``, which fixes it on every rank), after which the step compiles per length.


def symbolic_global(symbol: sympy.Symbol, world: int, rank: int, remainder: int) -> sympy.Expr:
    """G as a function of rank ``rank``'s shard symbol, for the length class ``G % world == remainder``."""
    return world * (symbol - int(rank < remainder)) + remainder


def symint(shape_env: object, expr: sympy.Expr, at: Mapping[sympy.Symbol, int]) -> int | torch.SymInt:
    """``expr`` (in the shard symbols) as a SymInt of ``shape_env``, or an int where it is constant;
    ``at``: the symbols' values in this trace (the hint)."""
    expr = sympy.expand(expr)
    if expr.is_number:
        return int(expr)
    return shape_env.create_symintnode(expr, hint=int(expr.subs(dict(at))))


def as_length(
    shape_env: object, expr: sympy.Expr, lengths: Mapping[sympy.Symbol, int], pinned: bool = False
) -> sympy.Expr:
    """``expr``, or the multiple of a length plus a constant that the trace's guards prove it is (no guard
    is added): ``2 * ((s - 1) // 2) + 2`` is ``s`` where a scan's recursion guarded on ``s`` being even.
    ``pinned``: the graph is compiled for the traced lengths only, where a size that takes a length's
    value is that length."""
    candidates = symbols_of(expr) & set(lengths)
    if not candidates or expr in lengths or affine(expr, next(iter(candidates)))[0] is not None:
        return expr
    hints = getattr(shape_env, "backed_var_to_val", {})
    value = expr.subs(hints)
    if symbols_of(expr) - set(hints) or not value.is_number:
        return expr
    value = int(value)
    if pinned:
        same = [symbol for symbol in candidates if value == hints[symbol]]
        if same:
            return same[0]
    traced = symint(shape_env, expr, hints)
    for symbol in candidates:
        length = int(hints[symbol])
        # the forms a * symbol + c that expr takes in this trace, a nearest the ratio of the two values
        scales = dict.fromkeys(max(1, round(value / length) + step) for step in (0, -1, 1)) if length else {}
        for form in (scale * symbol + (value - scale * length) for scale in scales):
            if statically_known_true(traced == symint(shape_env, form, hints)):
                return form
    return expr


def guard_at_global(
    shape_env: object, guards: Sequence[object], substitution: Mapping[sympy.Symbol, sympy.Expr]
) -> None:
    """Guard the frame on each of ``guards`` (Dynamo's, on the shard symbols) evaluated at the global
    length: a new length for which the model would branch otherwise on the whole sequence recompiles."""
    for guard in guards:
        if symbols_of(guard.expr) & set(substitution):
            shape_env.evaluate_expr(guard.expr.subs(dict(substitution)))


GLOBAL_LENGTH = sympy.Symbol("G", integer=True, positive=True)


def guards_on_global(shape_env: object, substitution: Mapping[sympy.Symbol, sympy.Expr]) -> list[sympy.Basic]:
    """Every guard on the shard symbols of ``substitution`` (symbol -> G in terms of it) as a condition
    on ``GLOBAL_LENGTH``: the same condition whichever rank recorded it."""
    local = {s: sympy.solve(sympy.Eq(GLOBAL_LENGTH, g), s)[0] for s, g in substitution.items()}
    conditions = []
    for guard in getattr(shape_env, "guards", ()):
        free = symbols_of(guard.expr)
        if free and free <= set(local):
            conditions.append(guard.expr.subs(local))
    return conditions


def install_guards(
    shape_env: object, conditions: Sequence[sympy.Basic], substitution: Mapping[sympy.Symbol, sympy.Expr]
) -> None:
    """Guard the frame on each of ``conditions`` (on ``GLOBAL_LENGTH``, from any rank), written in this
    rank's shard symbols; each holds at the traced length (every rank compiled at the same one)."""
    for condition in dict.fromkeys(conditions):
        for global_ in substitution.values():
            shape_env.evaluate_expr(sympy.sympify(condition).subs(GLOBAL_LENGTH, global_))


def pinned_symbols(shape_env: object, symbols_: Sequence[sympy.Symbol]) -> list[sympy.Symbol]:
    """The sequence symbols some step of compilation fixed to a number (by ``int()`` of a size)."""
    replacements = getattr(shape_env, "replacements", {})
    return [s for s in symbols_ if s in replacements and replacements[s].is_number]


def pinning_guard(shape_env: object, pinned: Sequence[sympy.Symbol]) -> str:
    """The guard that fixed one of ``pinned`` and where it was taken."""
    for guard in reversed(list(getattr(shape_env, "guards", ()))):
        if symbols_of(guard.expr) & set(pinned) and isinstance(guard.expr, sympy.Eq):
            return f"{guard.expr} at {guard.sloc.maybe_user_loc or guard.sloc}"
    return f"{pinned[0]} = {shape_env.replacements[pinned[0]]}"


# The sympy functions sizes are written in, and the Python function computing each on SymInts.
_SIZE_FUNCTIONS = (
    (sympy.Add, operator.add),
    (sympy.Mul, operator.mul),
    (FloorDiv, operator.floordiv),
    ((Mod, PythonMod), operator.mod),
    (Min, torch.sym_min),
    (Max, torch.sym_max),
)


def size_node(graph: fx.Graph, value: object) -> object:
    """``value`` as a graph argument: an int as is; a SymInt as nodes computing it from the graph's
    symbol placeholders, inserted after them (Note [One graph for every length])."""
    if not isinstance(value, torch.SymInt):
        return value
    expr = value.node.expr
    if expr.is_number:
        return int(expr)
    placeholders: dict[sympy.Expr, fx.Node] = {}
    anchor = None
    for node in graph.nodes:
        example = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(example, torch.SymInt):
            placeholders.setdefault(example.node.expr, node)
        elif node.op != "placeholder" and "autosp_size" not in node.meta:
            break
        if "autosp_size" in node.meta:
            placeholders.setdefault(node.meta["autosp_size"], node)
        anchor = node

    def build(term: sympy.Expr) -> object:
        if term.is_Integer:
            return int(term)
        if term in placeholders:
            return placeholders[term]
        function = next((f for kind, f in _SIZE_FUNCTIONS if isinstance(term, kind)), None)
        if function is None:
            raise NotImplementedError(f"size {term} has no graph form")
        parts = [build(arg) for arg in term.args]
        node = parts[0]
        for part in parts[1:]:  # folded left: Add and Mul take several terms, the others two
            node = emit(function, node, part)
        placeholders[term] = node
        return node

    def emit(function: object, left: object, right: object) -> fx.Node:
        nonlocal anchor
        with graph.inserting_after(anchor):
            node = graph.call_function(function, (left, right))
        values = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in (left, right)]
        node.meta["example_value"] = function(*values)
        node.meta["autosp_size"] = (
            sympy.sympify(node.meta["example_value"].node.expr)
            if isinstance(node.meta["example_value"], torch.SymInt)
            else node.meta["example_value"]
        )
        anchor = node
        return node

    if anchor is None:
        raise NotImplementedError("a graph without inputs has no sequence symbol")
    return build(expr)


def affine(expr: sympy.Expr, symbol: sympy.Symbol | None) -> tuple[int | None, int]:
    """(a, c) with ``expr == a * symbol + c`` in whole numbers; (None, 0) when it is not of that form (a
    remainder, a floor division, a product of lengths)."""
    if symbol is None:
        return 0, int(expr)
    try:
        polynomial = sympy.Poly(expr, symbol)
    except sympy.PolynomialError:
        return None, 0
    if polynomial.degree() > 1:
        return None, 0
    coefficients = polynomial.all_coeffs()
    scale, rest = coefficients if len(coefficients) == 2 else [0, coefficients[0]]
    if not (scale.is_integer and rest.is_integer):
        return None, 0
    return int(scale), int(rest)
