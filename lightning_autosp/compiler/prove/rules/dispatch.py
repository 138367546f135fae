"""Rules for a mixture of experts' token dispatch: this rank's own tokens, permuted and put back.

Note [Local token permutations]
    A dropless mixture of experts (transformers' ``grouped_mm`` experts: Mixtral, Qwen2/3-MoE, DeepSeek)
    is a function of each token alone: it sorts the (token, expert) slots by expert, gathers their
    hidden states, runs each expert's rows as one matrix product, weights them, and puts them back in
    slot order. Run on this rank's tokens, every step is a step of the single-device computation
    restricted to them, as long as nothing mixes rows of different tokens. So the pass needs no
    collective here, only a proof that the rows come back where they started:

    - ``sort`` / ``argsort`` of a value sharded along a flattened token dim (the slots' expert ids)
      gives ``rows(s)``: this rank's slots in the order of sort ``s``; its indices are the permutation;
    - gathering a token-sharded value (or a replicated table) by ``rows(s)`` indices, elementwise ops,
      per-row products (``linear``, ``grouped_mm``) and views that keep dim 0 stay ``rows(s)``;
    - ``histc`` / ``bincount`` of ``rows(s)`` values count this rank's slots per expert, ``counts(s)``:
      the group offsets of ``grouped_mm`` over the same rows (a ``cumsum`` over the experts keeps it);
    - ``inv = empty_like(p); inv[p] = arange(n)`` with ``p`` the sort's own indices is ``inverse(s)``;
    - ``rows[inv]`` is back in the order ``s`` sorted: the layout of the value it sorted.

    A sum over rows is a partial sum (a router's auxiliary loss is a mean over tokens); anything else
    that relates rows (a running count per expert for capacity, a softmax over tokens) is refused.
"""

from __future__ import annotations

import operator

from torch import fx

from lightning_autosp.compiler.fx_utils import meta_value
from lightning_autosp.compiler.prove.layout import PARTIAL, REPLICATE, Layout, rows
from lightning_autosp.compiler.prove.plan import Decided, decide
from lightning_autosp.compiler.prove.rules.common import ndim, tensor_nodes


def handles_local_order(rule):
    """Mark a rule that follows rows of this rank's tokens; other rules refuse them."""
    rule.handles_local_order = True
    return rule


FIX = "Dispatch tokens with a dropless sort by expert (transformers' grouped_mm experts), per token"


def sorts_local_tokens(a, node: fx.Node, dims: list[int]) -> bool:
    """Whether ``node`` sorts the slots of this rank's tokens: a 1-d value sharded along a flattened
    token dim, sorted along it, computed from activations (token data is recomputed whole instead)."""
    layout = a.layout(node.args[0])
    return (
        layout.kind == "shard"
        and layout.dims == (0,)
        and 0 in layout.flat
        and dims == [0]
        and ndim(node.args[0]) == 1
        and node not in a.token_data
    )


def sorted_rows(a, node: fx.Node, tuple_out: int) -> object:
    """sort / argsort of this rank's slots: values and indices in the sort's order."""
    layout = rows(node)
    return (layout,) * tuple_out if tuple_out else layout


def elementwise(a, node: fx.Node, layouts: list[Layout]) -> Layout | None:
    """Elementwise ops on permuted rows: every operand in the same order (or replicated); None if no
    operand is permuted."""
    local = [layout for layout in layouts if layout.is_local_order]
    if not local:
        return None
    if any(layout not in (local[0], REPLICATE) for layout in layouts):
        return a.refuse(
            node,
            f"combines rows of this rank's tokens in one order ({local[0]}) with values in another "
            f"({', '.join(sorted({str(x) for x in layouts}))})",
            FIX,
        )
    return local[0]


def gather(a, node: fx.Node, source: fx.Node, index: fx.Node) -> Layout | None:
    """``source[index]`` along dim 0 with a permuted index; None if ``index`` is not permuted."""
    by, of = a.layout(index), a.layout(source)
    if not by.is_local_order:
        return None
    if by.kind == "rows" and (of == REPLICATE or (of.kind == "shard" and 0 in of.dims)):
        return by  # rows of this rank's tokens (or a replicated table's rows, per slot), sorted
    if by.kind == "inverse" and of == rows(by.order):
        return a.layout(by.order.args[0])  # back in the order the sort found them
    return a.refuse(node, f"indexes a value of layout {of} by {by}", FIX)


def counts(a, node: fx.Node) -> Layout | None:
    """histc / bincount of permuted rows: this rank's slots per expert."""
    layout = a.layout(node.args[0])
    return rows(layout.order, "counts") if layout.kind == "rows" else None


@handles_local_order
def grouped_mm(a, node: fx.Node) -> Layout:
    """``grouped_mm(rows, weights[E, ...], offs=counts)``: each row times its expert's weight."""
    tensors = tensor_nodes([*node.args, *node.kwargs.values()])
    layouts = [a.layout(t) for t in tensors]
    source = a.layout(node.args[0])
    offsets = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    offsets_layout = a.layout(offsets)
    others = [x for t, x in zip(tensors, layouts) if t is not node.args[0] and t is not offsets]
    if (
        source.kind == "rows"
        and offsets_layout == rows(source.order, "counts")
        and all(x == REPLICATE for x in others)
    ):
        return source
    return a.refuse(
        node,
        f"multiplies rows of layout {source} by experts grouped by offsets of layout {offsets_layout}",
        FIX,
    )


def local_arange(a, node: fx.Node) -> Layout | None:
    """``arange(n)`` used only as the values of ``inv[p] = arange(n)`` (an inverse permutation): row
    numbers of this rank's slots, not positions in the sequence."""
    users = list(node.users)
    if users and all(_fills_inverse(a, user, node) for user in users):
        return rows(a.layout(users[0].args[1]).order)
    return None


def _fills_inverse(a, user: fx.Node, values: fx.Node) -> bool:
    if user.target is not operator.setitem or len(user.args) != 3 or user.args[2] is not values:
        return False
    index = user.args[1]
    return isinstance(index, fx.Node) and _is_permutation(a, index)


def _is_permutation(a, index: fx.Node) -> bool:
    """The indices a sort of this rank's slots returned (not a value derived from them)."""
    layout = a.layout(index)
    if layout.kind != "rows":
        return False
    sort = layout.order
    return index is sort or (index.target is operator.getitem and index.args == (sort, 1))


def inverse(a, node: fx.Node) -> Layout | None:
    """``inv[p] = arange(n)``: ``inv`` becomes the inverse permutation of sort ``p``; None if not."""
    target, index, values = node.args
    if not (isinstance(index, fx.Node) and _is_permutation(a, index)):
        return None
    order = a.layout(index).order
    if a.layout(values) != rows(order) or a.layout(target) != rows(order):
        return None
    if not _same_length(target, index, values):
        return None
    a.layouts[target] = rows(order, "inverse")  # the assignment changes what ``target`` holds
    return REPLICATE


def _same_length(*nodes: fx.Node) -> bool:
    shapes = [tuple(getattr(meta_value(n), "shape", ())) for n in nodes]
    return all(len(shape) == 1 for shape in shapes) and len({str(shape) for shape in shapes}) == 1


def reduce_rows(a, node: fx.Node, layout: Layout, reduced: list[int]) -> Decided:
    """A reduction of permuted rows: over dim 0 a sum over this rank's slots (partial), else per row."""
    if 0 not in reduced:
        return layout
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in ("sum", "nansum", "mean", "nanmean"):
        return decide(PARTIAL, "reductions") if name in ("mean", "nanmean") else PARTIAL
    return a.refuse(node, f"reduces ({name}) over rows of this rank's tokens", FIX)
