"""Row tiling: run a wide, row-wise region of a partitioned graph over tiles of its token rows.

Note [Row tiling]
    SAC rebuilds a block's MLP in backward from the block's saved input. fc1's output and the
    activation's are [S/P, 4h] each (3.5h for Llama-3's proportions), and with the gradients that flow
    through them backward holds several [S/P, 4h] values at once, for a region whose inputs and outputs
    are [S/P, h]. Every op of that region treats token rows independently (a matmul with a weight, a
    pointwise op, a norm over features) or sums over them (a weight's or a bias's gradient). So the
    region can compute the same values one tile of rows at a time: slice its row inputs into n tiles,
    run the region on each, concatenate its row outputs and add up its sums over rows::

        before:  x [S, h] -> mm(W1) [S, 4h] -> gelu [S, 4h] -> mm(W2) [S, h] -> y
        after:   x -> slice(0) -> mm -> gelu -> mm -> y0 [S/n, h] --+
                 ...                                               cat -> y [S, h]
                 x -> slice(n-1) -> mm -> gelu -> mm -> y(n-1) ----+

    Only one tile's wide values are live at a time: [S/(nP), 4h] instead of [S/P, 4h]. ALST's TiledMLP
    does this by hand in eager code; here it is a pass over the graphs the partitioner made, so the
    model is unchanged, and it tiles whatever region is row-wise and wide (an MLP, its recompute, its
    backward), not a named module.

    One rule per op (``_rules``) says whether the op can run per tile and how its output relates to the
    rows: ``Rows(d)`` (dim d indexes the rows), ``PARTIAL`` (a sum over rows: each tile adds its part),
    or None (nothing to do with rows: every tile uses it whole). Each rule is exact for any slicing of
    rows, so which dim is taken for the rows (a hidden size equal to the shard length, say) decides only
    what gets tiled, never a result. A region is a connected group of such ops. One that reaches itself
    again through an op outside it (the attention between two halves of a block) cannot run as one unit,
    so it is cut there and the ops after the cut form regions of their own. A region is tiled when its
    widest inner value (used only inside it) is at least ``min_bytes`` and wider than any value it takes
    in or hands on (those are whole, tiled or not), or as wide and not the only one; the number of tiles
    brings its inner values down to half the width of its inputs and outputs. Where the region's
    matmuls compute in 16 bits, no tile's inner values are narrower than half of ``min_bytes``: each
    tile's matmul pays a fixed cost per call (a kernel launch; on CPU, oneDNN's bfloat16 GEMM also
    repacks its weight every call, about 25 us, what 250 rows of a [*, 128] x [128, 448] GEMM take),
    and 16-bit GEMMs run fast enough for it to show at the widths of a short sequence. Llama-3's
    proportions in bf16 on 2 ranks at 2048 tokens (1.75 MiB inner values): 7 tiles took 1.11x SP
    alone's step, 3 tiles 1.04x, for the same peak (14.5 MiB; 16.4 untiled). An fp32 GEMM there is
    proportional to its rows (8 tiles of one: 1.02x its time), and a tile floor would only cost memory
    (the GPT on 4 ranks at 5120 tokens: 32.8 MiB with it, 31.4 in the trainability search's launch with
    its 8 tiles).

    Sums over rows are added tile by tile in float32 when the op computes in a narrower dtype, so a
    bfloat16 weight gradient is rounded once, as without tiling.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import Emitter
from lightning_autosp.compiler.partition.tiling_rules import (
    Partial,
    Rows,
    Site,
    TileLayout,
    TileRule,
    aten,
    node_bytes,
    rule_for,
    same_size,
    value_of,
)

log = logging.getLogger(__name__)

# At most this many tiles a region (Note [Row tiling]).
MAX_TILES = 8
# The matmuls of linear layers (forward and backward) once Dynamo's graph is lowered to ATen.
_MATMULS = (aten.mm.default, aten.addmm.default)


@dataclass
class Region:
    """Ops that run together per tile; ``outputs`` are those with users outside the region."""

    nodes: list[fx.Node]
    outputs: list[fx.Node] = field(default_factory=list)
    tiles: int = 1
    inner_bytes: int = 0  # the widest value used only inside the region


@dataclass
class TilingReport:
    regions: int = 0
    tiles: int = 0
    inner_bytes: int = 0  # the widest inner value of the tiled regions, before tiling

    def line(self) -> str:
        if not self.regions:
            return "no region tiled"
        return (
            f"{self.regions} row-wise regions run in {self.tiles} tiles each at most "
            f"(widest inner value {self.inner_bytes / 2**20:.2f} MiB before tiling)"
        )


# -------------------------------------------------------------------------------------------- analysis


def row_count(graph: fx.Graph) -> object | None:
    """The graph's token rows: the most common row count of the left operands of its matmuls (every
    linear layer, forward and backward, multiplies ``[B*S, in]`` by a weight; a weight's gradient, whose
    left operand is transposed, is one matmul per layer against four)."""
    counts: Counter = Counter()
    sizes: dict[object, object] = {}
    for node in graph.nodes:
        if node.target not in _MATMULS:
            continue
        left = value_of(node.args[-2])
        if isinstance(left, torch.Tensor) and left.dim() == 2:
            key = symbols.raw_expr(left.shape[0])
            counts[key] += 1
            sizes[key] = left.shape[0]
    if not counts:
        return None
    return sizes[counts.most_common(1)[0][0]]


def _seed(node: fx.Node, rows: object) -> TileLayout:
    """A value computed whole: rows where exactly one dim has the row count (a tuple is never sliced;
    its items are, through their getitems)."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return None
    dims = [d for d, size in enumerate(value.shape) if same_size(size, rows)]
    return Rows(dims[0]) if len(dims) == 1 else None


def _tiled(layout: object) -> bool:
    items = layout if isinstance(layout, tuple) else (layout,)
    return any(item is not None for item in items)


def find_regions(
    graph: fx.Graph, rows: object
) -> tuple[list[Region], dict[fx.Node, TileRule], dict[fx.Node, object]]:
    """Every convex group of ops that can run per tile (Note [Row tiling]), with their rules and layouts.

    1. Give every op its rule, from its inputs' layouts (``_propagate``).
    2. Split the ops that have one into convex pieces (``_levels``), then join two pieces connected by an
       edge wherever their union stays convex (a block's recompute and its backward).
    3. An edge cut between pieces must carry rows: the consumer then reads a whole value, sliced as
       rows. Where one carries a sum over rows, its consumer is taken out and everything redone.
    """
    excluded: set[fx.Node] = set()
    while True:
        rules, layouts = _propagate(graph, rows, excluded)
        piece = _levels(graph, rules)
        _join(graph, rules, piece)
        cut = {b for b in rules for a in b.all_input_nodes if a in rules and piece[a] is not piece[b]}
        broken = {
            b
            for b in cut
            if any(
                a in rules and piece[a] is not piece[b] and not isinstance(layouts[a], Rows)
                for a in b.all_input_nodes
            )
        }
        if not broken:
            break
        excluded |= broken
    members: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if node in rules:
            members.setdefault(id(piece[node]), []).append(node)
    regions = []
    for nodes in members.values():
        inside = set(nodes)
        regions.append(Region(nodes, [n for n in nodes if any(user not in inside for user in n.users)]))
    return regions, rules, layouts


def _propagate(
    graph: fx.Graph, rows: object, excluded: set[fx.Node]
) -> tuple[dict[fx.Node, TileRule], dict[fx.Node, object]]:
    layouts: dict[fx.Node, object] = {}
    rules: dict[fx.Node, TileRule] = {}
    for node in graph.nodes:
        rule_fn = rule_for(node) if node.op == "call_function" and node not in excluded else None
        if rule_fn is not None:
            rule = rule_fn(Site(node, layouts, rows))
            if rule is not None and _tiled(rule.output):
                rules[node], layouts[node] = rule, rule.output
                continue
        layouts[node] = _seed(node, rows)
    return rules, layouts


def _levels(graph: fx.Graph, rules: dict[fx.Node, TileRule]) -> dict[fx.Node, set[fx.Node]]:
    """Pieces of the tileable ops, each convex: an op's level counts how often a path to it left the
    tileable ops and came back; ops of one level connected by edges form a piece. A path that leaves a
    piece comes back only at a higher level, so never to the piece."""
    level: dict[fx.Node, int] = {}
    reached: dict[fx.Node, int] = {}  # other ops: the highest level of a tileable op before them
    for node in graph.nodes:
        tileable = node in rules
        seen = [
            level[a] if a in rules else reached[a] + tileable
            for a in node.all_input_nodes
            if a in rules or a in reached
        ]
        if tileable:
            level[node] = max(seen, default=0)
        elif seen:
            reached[node] = max(seen)
    piece: dict[fx.Node, set[fx.Node]] = {}
    for node in graph.nodes:
        if node not in rules:
            continue
        own = {node}
        for arg in node.all_input_nodes:
            if (
                arg in rules
                and level[arg] == level[node]
                and piece[arg] is not own
                and not _bridge(arg, rules)
            ):
                other = piece[arg]
                if len(other) > len(own):
                    own, other = other, own
                own |= other
                for member in other:
                    piece[member] = own
        for member in own:
            piece[member] = own
    return piece


def _bridge(node: fx.Node, rules: dict[fx.Node, TileRule]) -> bool:
    """Whether ``node`` only reshapes graph inputs for several readers: a view of the rotary tables that
    every layer reads. Joining its readers through it would make one region of all the layers (Note
    [Layers that recompute attention]); each reader takes it as an input instead."""
    return len(node.users) > 1 and not any(arg in rules for arg in node.all_input_nodes)


def _join(graph: fx.Graph, rules: dict[fx.Node, TileRule], piece: dict[fx.Node, set[fx.Node]]) -> None:
    """Join pieces connected by an edge, in graph order, where the union stays convex."""
    # Pieces found not joinable, by identity (a join makes a new set); ``kept`` keeps their ids unique.
    apart: set[tuple[int, int]] = set()
    kept: list[set[fx.Node]] = []
    for node in graph.nodes:
        if node not in rules:
            continue
        for arg in node.all_input_nodes:
            if arg not in rules or piece[arg] is piece[node] or (id(piece[arg]), id(piece[node])) in apart:
                continue
            if _bridge(arg, rules):
                continue
            union = piece[arg] | piece[node]
            if _convex(union):
                for member in union:
                    piece[member] = union
            else:
                apart.add((id(piece[arg]), id(piece[node])))
                kept += [piece[arg], piece[node]]


def _convex(nodes: set[fx.Node]) -> bool:
    """Whether no path leaves ``nodes`` and comes back to them."""
    leaving = [user for n in nodes for user in n.users if user not in nodes]
    return not (_closure(leaving, lambda n: n.users) | set(leaving)) & nodes


def _closure(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [n for s in start for n in step(s)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def choose_tiles(region: Region, layouts: dict[fx.Node, object], min_bytes: int, max_tiles: int) -> int:
    """How many tiles the region runs in (1: not tiled), from the width of its inner values: those it
    allocates and hands on to no one, not even as a view. What it hands on is rebuilt whole with the
    strides it had (a saved tensor's strides are part of the backward graph), so its memory must be dense."""
    inside = set(region.nodes)
    if any(not isinstance(value_of(o), torch.Tensor) for o in region.outputs):
        return 1
    handed = {_storage(o, inside) for o in region.outputs}
    inner = [n for n in region.nodes if n not in handed and _allocates(n)]
    inputs = {a for n in region.nodes for a in n.all_input_nodes if a not in inside}
    row_inputs = [a for a in inputs if isinstance(layouts[a], Rows)]
    row_outputs = [o for o in region.outputs if isinstance(layouts[o], Rows)]  # sums over rows: weights' size
    boundary = max(node_bytes(n) for n in [*row_inputs, *row_outputs])
    widths = [node_bytes(n) for n in inner]
    region.inner_bytes = max(widths, default=0)
    # The edges are whole, tiled or not; tiles shrink the inner values. Worth it where they are wider
    # than every edge, or as wide and several (q, k and v cross the all-to-all packed: [S, 3h] beside
    # a [S, 4h] MLP; [S, 2h] beside a Llama's gate and up at 2h), not for one value of an edge's width.
    wide = sum(width >= boundary for width in widths)
    if (
        not row_inputs
        or region.inner_bytes < max(min_bytes, 1)
        or wide < (1 if region.inner_bytes > boundary else 2)
    ):
        return 1
    rebuilt = {_storage(o, inside) for o in row_outputs}
    if any(_stride_order(value_of(root)) is None for root in rebuilt):
        return 1
    narrow = any(_narrow_matmul(n) for n in region.nodes)
    return tile_count(region.inner_bytes, boundary, min_bytes, max_tiles, narrow)


def tile_count(inner_bytes: int, boundary_bytes: int, min_bytes: int, max_tiles: int, narrow: bool) -> int:
    """Tiles for a region worth tiling: its inner values at half the width of its edges (a [S, 4h] MLP runs
    in 8 tiles); with 16-bit matmuls (``narrow``) none narrower than half of ``min_bytes`` (Note [Row
    tiling]). The planner prices a rebuilt MLP with it too (``planning/memory_model.mlp_tiles``)."""
    tiles = min(max_tiles, math.ceil(2 * inner_bytes / max(boundary_bytes, 1)))
    if min_bytes > 1 and narrow:
        tiles = min(tiles, inner_bytes // (min_bytes // 2))
    return max(2, tiles)


def _narrow_matmul(node: fx.Node) -> bool:
    value = value_of(node)
    return node.target in _MATMULS and isinstance(value, torch.Tensor) and value.dtype.itemsize < 4


def _storage(node: fx.Node, inside: set[fx.Node]) -> fx.Node:
    """The op in the region that allocated the memory ``node`` views (a split's piece views its input)."""
    while node.all_input_nodes and node.all_input_nodes[0] in inside:
        source = node.all_input_nodes[0]
        splits = node.target is operator.getitem and getattr(source.target, "_overloadpacket", None) in (
            aten.split,
            aten.split_with_sizes,
        )
        views = not _allocates(node) and node.target is not operator.getitem
        if not (views or splits):
            break
        if splits:  # the split's pieces view its input
            if not source.all_input_nodes or source.all_input_nodes[0] not in inside:
                break
            source = source.all_input_nodes[0]
        node = source
    return node


def _stride_order(value: torch.Tensor) -> list[int] | None:
    """The dims from outermost to innermost when ``value`` is dense in some order of its dims, else None."""
    strides = [symbols.concrete(s) for s in value.stride()]
    order = sorted(range(value.dim()), key=lambda d: -strides[d])
    expected = 1
    for dim in reversed(order):
        if symbols.concrete(value.shape[dim]) != 1 and not same_size(value.stride()[dim], expected):
            return None
        expected = expected * value.shape[dim]
    return order


def _allocates(node: fx.Node) -> bool:
    packet = getattr(node.target, "_overloadpacket", None)
    return node.target is not operator.getitem and packet not in (
        aten.view,
        aten._unsafe_view,
        aten.permute,
        aten.t,
        aten.transpose,
        aten.unsqueeze,
        aten.squeeze,
        aten.alias,
        aten.slice,
        aten.split,
        aten.split_with_sizes,
    )


# ---------------------------------------------------------------------------------------------- lowering


def tile_rows_pass(gm: fx.GraphModule, *, min_bytes: int, max_tiles: int = MAX_TILES) -> TilingReport:
    """Run each wide row-wise region of ``gm`` (a partitioned forward or backward) over tiles of rows
    (Note [Row tiling]). Returns what was tiled; ``gm`` is recompiled if anything was."""
    report = TilingReport()
    rows = row_count(gm.graph)
    widest = max((node_bytes(n) for n in gm.graph.nodes if n.op == "call_function"), default=0)
    if rows is None or widest < min_bytes:  # nothing to gain: skip the analysis
        return report
    # At most a row a tile at this length, and no tile empty at every length the graph serves (Inductor
    # cannot lower a loop it proves empty). A graph for every length of a class tiles with bounds in its
    # symbol; the fake values of tiles guard on them being non-empty, so a much shorter length compiles
    # again, into a graph too small to tile (Note [Row tiling]).
    max_tiles = min(max_tiles, symbols.concrete(rows), _most(rows))
    regions, rules, layouts = find_regions(gm.graph, rows)
    for region in regions:
        region.tiles = choose_tiles(region, layouts, min_bytes, max_tiles)
        if region.tiles > 1:
            _lower(gm.graph, region, rules, layouts, rows)
            report.regions += 1
            report.tiles = max(report.tiles, region.tiles)
            report.inner_bytes = max(report.inner_bytes, region.inner_bytes)
    if report.regions:
        gm.graph.lint()
        gm.recompile()
        log.info("row tiling: %s", report.line())
    return report


def _most(rows: object) -> int:
    """The largest value a row count can take in this graph (a large number when unbounded)."""
    if not isinstance(rows, torch.SymInt):
        return int(rows)
    upper = rows.node.shape_env.bound_sympy(rows.node.expr).upper
    return int(upper) if getattr(upper, "is_Integer", False) else 1 << 62


def _lower(
    graph: fx.Graph,
    region: Region,
    rules: dict[fx.Node, TileRule],
    layouts: dict[fx.Node, object],
    rows: object,
) -> None:
    """Replace ``region`` by ``region.tiles`` copies of it, one per tile of rows, placed after its last op."""
    inside = set(region.nodes)
    first, last = region.nodes[0], region.nodes[-1]
    # Ops between the region's first and last that use its outputs must now run after it.
    movers, depends, window = [], set(inside), False
    for node in graph.nodes:
        if node is first:
            window = True
        elif node is last:
            break
        elif window and node not in inside and any(a in depends for a in node.all_input_nodes):
            depends.add(node)
            movers.append(node)

    emit = Emitter(graph, last)
    inputs = [a for n in region.nodes for a in n.all_input_nodes if a not in inside]
    row_inputs = {a: layouts[a] for a in dict.fromkeys(inputs) if isinstance(layouts[a], Rows)}
    total: object = rows
    if not isinstance(rows, int):
        source, layout = next(iter(row_inputs.items()))
        total = emit.call(aten.sym_size.int, (source, layout.dim))
    # Every tile but the last has rows // tiles rows (the last the rest): one size expression for them all.
    # Bounds at k * rows // tiles gave each tile its own, and the fake values of ~30 ops a tile then did
    # symbolic arithmetic on each: half of an 8-layer GPT's aot_eager compile at 2048 tokens went there.
    step = emit.size(operator.floordiv, total, region.tiles)
    bounds = [0] + [emit.size(operator.mul, step, k) for k in range(1, region.tiles)] + [total]

    # Row outputs are rebuilt from the memory they view: its tiles concatenated, the views replayed.
    roots = list(dict.fromkeys(_storage(o, inside) for o in region.outputs if isinstance(layouts[o], Rows)))
    pieces: dict[fx.Node, list[fx.Node]] = {root: [] for root in roots}
    sums: dict[fx.Node, fx.Node] = {}
    for k in range(region.tiles):
        start, end = bounds[k], bounds[k + 1]
        length = step if k < region.tiles - 1 else emit.size(operator.sub, end, start)
        tile: dict[fx.Node, fx.Node] = {}

        def argument(arg: fx.Node, start: object = start, end: object = end, tile: dict = tile) -> fx.Node:
            if arg in tile:
                return tile[arg]
            if arg in row_inputs:
                tile[arg] = emit.call(aten.slice.Tensor, (arg, row_inputs[arg].dim, start, end))
                return tile[arg]
            return arg

        for node in region.nodes:
            args = fx.node.map_arg(node.args, argument)
            kwargs = fx.node.map_arg(node.kwargs, argument)
            if rules[node].resize is not None:
                args = rules[node].resize(args, length)
            tile[node] = _copy(emit, node, args, kwargs)
        for output in region.outputs:
            if isinstance(rules[output].output, Partial):
                sums[output] = _accumulate(emit, sums.get(output), tile[output], output)
        for root in roots:
            pieces[root].append(tile[root])

    wholes = {root: _concatenate(emit, pieces[root], layouts[root].dim, value_of(root)) for root in roots}
    for output in region.outputs:
        if output in sums:
            whole = sums[output]
            if value_of(whole).dtype != value_of(output).dtype:
                whole = emit.call(
                    torch.ops.prims.convert_element_type.default, (whole, value_of(output).dtype)
                )
        else:
            whole = _replay_views(emit, output, inside, wholes)
        output.replace_all_uses_with(whole, delete_user_cb=lambda user: user not in inside)
        layouts[whole] = layouts[output] if isinstance(layouts[output], Rows) else None  # for later regions
    for node in reversed(region.nodes):
        graph.erase_node(node)
    anchor = emit.anchor
    for node in movers:
        anchor.append(node)
        anchor = node


def _concatenate(emit: Emitter, pieces: list[fx.Node], dim: int, like: torch.Tensor) -> fx.Node:
    """The tiles joined along ``dim``, with the strides ``like`` has (dense in its own order of dims)."""
    order = _stride_order(like)
    if order == sorted(order):
        return emit.call(aten.cat.default, (pieces, dim))
    permuted = [emit.call(aten.permute.default, (piece, order)) for piece in pieces]
    joined = emit.call(aten.cat.default, (permuted, order.index(dim)))
    return emit.call(aten.permute.default, (joined, [order.index(d) for d in range(len(order))]))


def _replay_views(
    emit: Emitter, output: fx.Node, inside: set[fx.Node], wholes: dict[fx.Node, fx.Node]
) -> fx.Node:
    chain = [output]
    while chain[-1] not in wholes:
        chain.append(chain[-1].all_input_nodes[0])
    value = wholes[chain.pop()]
    for node in reversed(chain):
        args = (value, *node.args[1:])
        value = emit.call(node.target, args, dict(node.kwargs), like=node)
    return value


def _copy(emit: Emitter, node: fx.Node, args: tuple, kwargs: dict) -> fx.Node:
    """The node's op on one tile. A view becomes a reshape: a tile of a value another op laid out (a
    transposed gradient) need not have strides the view can keep, and a reshape copies only then."""
    target = (
        aten.reshape.default if node.target in (aten.view.default, aten._unsafe_view.default) else node.target
    )
    return emit.call(target, args, kwargs, like=node)


def _accumulate(emit: Emitter, total: fx.Node | None, piece: fx.Node, output: fx.Node) -> fx.Node:
    """Add a tile's part of a sum over rows, in float32 when the op computes in a narrower dtype."""
    dtype = value_of(output).dtype
    if dtype.is_floating_point and dtype.itemsize < 4:
        piece = emit.call(torch.ops.prims.convert_element_type.default, (piece, torch.float32))
    return piece if total is None else emit.call(aten.add.Tensor, (total, piece))
