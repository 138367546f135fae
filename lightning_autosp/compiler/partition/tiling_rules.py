"""The rule table of row tiling (Note [Row tiling] in ``tiling.py``): per ATen op, whether it can run on
one tile of rows and how its output relates to the rows.

A rule reads the op's node and the layouts of its inputs (``Site``) and answers with a ``TileRule``: the
output's layout and, for an op whose arguments name the row count (a view's shape), how to write them
for a tile. No answer: the op runs whole, outside any tiled region. Every answer is exact for any
slicing of the rows, so a wrong guess of which dim holds the rows costs memory, never a result.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import value_of

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """Dim ``dim`` of the value indexes the rows: a tile is ``value.narrow(dim, start, length)``."""

    dim: int


@dataclass(frozen=True)
class Partial:
    """A sum over rows: the value is the sum of what each tile computes."""


PARTIAL = Partial()
TileLayout = Rows | Partial | None  # None: not indexed by rows, used whole by every tile
Resize = Callable[[tuple, object], tuple]  # (args of the node, a tile's length) -> args for that tile


@dataclass(frozen=True)
class TileRule:
    """A rule's answer: the layout of the op's output (a tuple for ops with several), and how its
    arguments change for a tile (a view's target shape names the row count)."""

    output: TileLayout | tuple[TileLayout, ...]
    resize: Resize | None = None


def node_bytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value (0 for anything else); sizes that are sequence symbols are read at
    their traced value, without guarding on them."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return 0
    return symbols.concrete(value.numel()) * value.element_size()


def same_size(a: object, b: object) -> bool:
    """Whether two sizes are equal for every value of their symbols (no guard is installed)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _dims(dims: object, rank: int) -> set[int]:
    if dims is None or dims == []:
        return set(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return {d % rank for d in dims}


@dataclass
class Site:
    """What a rule reads: the node, its arguments' layouts, the row count."""

    node: fx.Node
    layouts: dict[fx.Node, TileLayout]
    rows: object

    def layout(self, arg: object) -> TileLayout:
        return self.layouts.get(arg) if isinstance(arg, fx.Node) else None

    def arg_layouts(self) -> list[TileLayout]:
        return [self.layout(a) for a in self.node.all_input_nodes]


def _pointwise(site: Site) -> TileRule | None:
    """Elementwise ops (with broadcasting): rows stay rows; a sum over rows only through linear ops."""
    node, out = site.node, value_of(site.node)
    if not isinstance(out, torch.Tensor):
        return None
    if any(isinstance(layout, Partial) for layout in site.arg_layouts()):
        return _linear(site)
    row_dims = set()
    for arg in node.all_input_nodes:
        value, layout = value_of(arg), site.layout(arg)
        if isinstance(layout, Rows) and isinstance(value, torch.Tensor):
            row_dims.add(layout.dim + out.dim() - value.dim())
    if len(row_dims) != 1:
        return None
    (dim,) = row_dims
    if not 0 <= dim < out.dim() or not same_size(out.shape[dim], site.rows):
        return None
    for arg in node.all_input_nodes:  # a whole operand must broadcast over the rows
        value = value_of(arg)
        if site.layout(arg) is None and isinstance(value, torch.Tensor):
            own = dim - (out.dim() - value.dim())
            if own >= 0 and not same_size(value.shape[own], 1):
                return None
    return TileRule(Rows(dim))


def _linear(site: Site) -> TileRule | None:
    """Sums over rows pass through a + b, a - b (both sums), a * c, a / c (c whole) and -a."""
    node, name = site.node, site.node.target._overloadpacket.__name__
    layouts = [site.layout(a) if isinstance(a, fx.Node) else None for a in node.args]
    if name in ("add", "sub") and len(node.args) == 2 and all(isinstance(x, Partial) for x in layouts):
        return TileRule(PARTIAL) if node.kwargs.get("alpha", 1) == 1 else None
    if name in ("mul", "div") and len(node.args) == 2:
        whole = [x is None for x in layouts]
        if (
            isinstance(layouts[0], Partial)
            and whole[1]
            or name == "mul"
            and isinstance(layouts[1], Partial)
            and whole[0]
        ):
            return TileRule(PARTIAL)
    if name == "neg":
        return TileRule(PARTIAL)
    return None


def _matmul(site: Site) -> TileRule | None:
    """``mm(a, b)``: rows of a give rows of the product; rows as the contracted dim give a sum."""
    node = site.node
    bias, (a, b) = (node.args[0], node.args[1:3]) if len(node.args) >= 3 else (None, node.args[:2])
    layout_a, layout_b = site.layout(a), site.layout(b)
    if bias is not None:
        bias_value = value_of(bias)
        if site.layout(bias) is not None:
            return None
        if (
            isinstance(bias_value, torch.Tensor)
            and bias_value.dim() == 2
            and not same_size(bias_value.shape[0], 1)
        ):
            return None
    if layout_a == Rows(0) and layout_b is None:
        return TileRule(Rows(0))
    if layout_a is None and layout_b == Rows(1):
        return TileRule(Rows(1))
    if bias is None and layout_a == Rows(1) and layout_b == Rows(0):
        return TileRule(PARTIAL)
    return None


def _view(site: Site) -> TileRule | None:
    """A view keeps the rows when some output dim has the same size and the same dims before it."""
    node = site.node
    source, layout, out = node.args[0], site.layout(node.args[0]), value_of(node)
    if isinstance(layout, Partial):
        return TileRule(PARTIAL)
    if not isinstance(layout, Rows) or not isinstance(out, torch.Tensor):
        return None
    before = math.prod(value_of(source).shape[: layout.dim])
    for dim, size in enumerate(out.shape):
        if same_size(size, site.rows) and same_size(math.prod(out.shape[:dim]), before):
            return TileRule(Rows(dim), resize=lambda args, length, dim=dim: _with_size(args, 1, dim, length))
    return None


def _with_size(args: tuple, position: int, dim: int, length: object) -> tuple:
    shape = list(args[position])
    if shape[dim] != -1:
        shape[dim] = length
    return (*args[:position], shape, *args[position + 1 :])


def _permute(site: Site) -> TileRule | None:
    node = site.node
    layout, name, out = site.layout(node.args[0]), node.target._overloadpacket.__name__, value_of(node)
    if isinstance(layout, Partial):
        return TileRule(PARTIAL)
    if not isinstance(layout, Rows):
        return None
    rank = out.dim()
    if name == "permute":
        order = [d % rank for d in node.args[1]]
    elif name == "t":
        order = [1, 0] if rank == 2 else [0]
    else:  # transpose
        order = list(range(rank))
        first, second = node.args[1] % rank, node.args[2] % rank
        order[first], order[second] = second, first
    return TileRule(Rows(order.index(layout.dim)))


def _unsqueeze(site: Site) -> TileRule | None:
    layout, out = site.layout(site.node.args[0]), value_of(site.node)
    if isinstance(layout, Partial):
        return TileRule(PARTIAL)
    if not isinstance(layout, Rows):
        return None
    dim = site.node.args[1] % out.dim()
    return TileRule(Rows(layout.dim + (dim <= layout.dim)))


def _squeeze(site: Site) -> TileRule | None:
    node = site.node
    layout, source = site.layout(node.args[0]), value_of(node.args[0])
    if isinstance(layout, Partial):
        return TileRule(PARTIAL)
    if not isinstance(layout, Rows) or len(node.args) < 2:
        return None
    removed = {d for d in _dims(node.args[1], source.dim()) if same_size(source.shape[d], 1)}
    if layout.dim in removed:
        return None
    return TileRule(Rows(layout.dim - sum(d < layout.dim for d in removed)))


def _reduction(site: Site) -> TileRule | None:
    """Reductions over other dims keep the rows; a sum over the rows is a sum of tiles."""
    node = site.node
    name, layout, source = (
        node.target._overloadpacket.__name__,
        site.layout(node.args[0]),
        value_of(node.args[0]),
    )
    if isinstance(layout, Partial):
        return TileRule(PARTIAL) if name == "sum" and "dtype" not in node.kwargs else None
    if not isinstance(layout, Rows):
        return None
    dims = _dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), source.dim())
    keepdim = node.args[2] if len(node.args) > 2 and name != "var_mean" else node.kwargs.get("keepdim", False)
    if layout.dim in dims:
        return TileRule(PARTIAL) if name == "sum" else None
    dim = layout.dim if keepdim else layout.dim - sum(d < layout.dim for d in dims)
    return TileRule((Rows(dim), Rows(dim)) if name == "var_mean" else Rows(dim))


def _layer_norm(site: Site) -> TileRule | None:
    node = site.node
    layout, source = site.layout(node.args[0]), value_of(node.args[0])
    if not isinstance(layout, Rows) or layout.dim >= source.dim() - len(node.args[1]):
        return None
    if any(site.layout(a) is not None for a in node.args[2:4]):
        return None
    return TileRule((Rows(layout.dim),) * 3)


def _layer_norm_backward(site: Site) -> TileRule | None:
    """Row gradients per tile; the weight's and bias's gradients are sums over rows."""
    grad, source, normalized, mean, rstd, weight, bias = site.node.args[:7]
    layouts = {site.layout(a) for a in (grad, source, mean, rstd)}
    if len(layouts) != 1 or not isinstance(next(iter(layouts)), Rows):
        return None
    (layout,) = layouts
    if layout.dim >= value_of(source).dim() - len(normalized) or site.layout(weight) or site.layout(bias):
        return None
    return TileRule((layout, PARTIAL, PARTIAL))


def _along_other_dim(site: Site) -> TileRule | None:
    """split / slice / cat along a dim that is not the rows."""
    node = site.node
    name = node.target._overloadpacket.__name__
    if name == "cat":
        pieces = node.args[0]
        layouts = {site.layout(p) for p in pieces}
        dim = (node.args[1] if len(node.args) > 1 else 0) % value_of(node).dim()
        if len(layouts) != 1 or not isinstance(next(iter(layouts)), Rows) or next(iter(layouts)).dim == dim:
            return None
        return TileRule(next(iter(layouts)))
    layout, source = site.layout(node.args[0]), value_of(node.args[0])
    if not isinstance(layout, Rows):
        return None
    position = 1 if name == "slice" else 2
    dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
    if dim % source.dim() == layout.dim:
        return None
    if name == "slice":
        return TileRule(layout)
    return TileRule((layout,) * len(value_of(node)))


def _expand(site: Site) -> TileRule | None:
    """An expand of rows (a norm's statistics over features) keeps them; the tile expands to its length."""
    node = site.node
    layout, source, out = site.layout(node.args[0]), value_of(node.args[0]), value_of(node)
    if not isinstance(layout, Rows):
        return None
    dim = layout.dim + out.dim() - source.dim()
    return TileRule(Rows(dim), resize=lambda args, length, dim=dim: _with_size(args, 1, dim, length))


def _slice_backward(site: Site) -> TileRule | None:
    """The gradient of a slice along another dim: zeros around it, rows kept."""
    grad, sizes, dim = site.node.args[:3]
    layout = site.layout(grad)
    if not isinstance(layout, Rows) or dim % len(sizes) == layout.dim:
        return None
    return TileRule(layout, resize=lambda args, length: _with_size(args, 1, layout.dim, length))


def _slice_scatter(site: Site) -> TileRule | None:
    base, source = site.node.args[:2]
    dim = site.node.args[2] if len(site.node.args) > 2 else site.node.kwargs.get("dim", 0)
    layout = site.layout(base)
    if (
        not isinstance(layout, Rows)
        or site.layout(source) != layout
        or dim % value_of(base).dim() == layout.dim
    ):
        return None
    return TileRule(layout)


def _getitem(site: Site) -> TileRule | None:
    parent, index = site.node.args
    layouts = site.layout(parent)
    if not isinstance(layouts, tuple) or not isinstance(index, int):
        return None
    return TileRule(layouts[index])


def _rules() -> dict[object, Callable[[Site], TileRule | None]]:
    """Op overload packet -> rule; ops tagged pointwise use ``_pointwise``; anything else is not tiled."""
    rules: dict[object, Callable[[Site], TileRule | None]] = {
        aten.mm: _matmul,
        aten.addmm: _matmul,
        aten.view: _view,
        aten._unsafe_view: _view,
        aten.reshape: _view,
        aten.permute: _permute,
        aten.t: _permute,
        aten.transpose: _permute,
        aten.unsqueeze: _unsqueeze,
        aten.squeeze: _squeeze,
        aten.sum: _reduction,
        aten.mean: _reduction,
        aten.amax: _reduction,
        aten.amin: _reduction,
        aten.var_mean: _reduction,
        aten.native_layer_norm: _layer_norm,
        aten.native_layer_norm_backward: _layer_norm_backward,
        aten.split: _along_other_dim,
        aten.split_with_sizes: _along_other_dim,
        aten.slice: _along_other_dim,
        aten.cat: _along_other_dim,
        aten.alias: _pointwise,
        aten.detach: _pointwise,
        aten.expand: _expand,
        aten.slice_backward: _slice_backward,
        aten.slice_scatter: _slice_scatter,
        aten._to_copy: _pointwise,
    }
    return rules


RULES = _rules()


def rule_for(node: fx.Node) -> Callable[[Site], TileRule | None] | None:
    if node.target is operator.getitem:
        return _getitem
    packet = getattr(node.target, "_overloadpacket", None)
    tags = getattr(node.target, "tags", ())
    if packet is None or torch.Tag.nondeterministic_seeded in tags or packet.__name__.endswith("_"):
        return None
    if packet in RULES:
        return RULES[packet]
    return _pointwise if torch.Tag.pointwise in tags else None
