"""Every rank runs the collectives of a compiled graph in one order: the order of the graph.

Note [Collective order]
    Ranks whose shards differ in length (61 tokens over 2 ranks: 31 + 30) compile graphs of different
    sizes, and Inductor's scheduler may order independent nodes differently for different sizes. Two
    collectives with no data dependency between them then run in different orders on different
    ranks: in attention's backward the all-to-alls of dq, dk and dv are independent, and one rank
    sent dq while the other sent dv. The shapes agree, so nothing failed; every gradient upstream of
    that attention was silently wrong (a GPT at 61 tokens, batch 1, Inductor: relative error 1.2).

    The partitioner does not keep that order either: it may emit independent nodes of the backward in
    an order that differs between processes (seen on a Mamba-2 scan, where one rank sent the gradient of
    one all-to-all while the other sent another's: a hang where the sizes differed). So after
    partitioning, ``order_collectives`` puts each graph's collectives in a canonical order, the order of
    the forward ops they belong to (their autograd ``seq_nr``: ascending in the forward, descending in
    the backward, which is the order data flows in either), moving nodes only as their inputs allow.
    A collective that backward re-runs (Note [Layers that recompute attention] in ``memory_policy.py``)
    keeps its forward op's number; where the numbers contradict the data, a collective computed from
    another still comes after it (``_canonical_order``).
    Then this post-grad pass chains the collectives of each graph Inductor compiles in that order with
    Inductor's control dependencies, so the scheduler cannot swap them; ``aot_eager`` runs the graphs
    in their order.
"""

from __future__ import annotations

import hashlib
import heapq
import inspect
from collections.abc import Callable

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from lightning_autosp.compiler.runtime.ops import is_collective


def order_collectives(graph: fx.Graph, *, backward: bool) -> None:
    """Reorder ``graph`` (a partitioned forward or backward) so its collectives run in the order of the
    forward ops they belong to, the same on every rank (Note [Collective order]); other nodes keep their
    order as far as their inputs allow."""
    collectives = collectives_in_order(graph)
    if any("seq_nr" not in node.meta for node in collectives):
        return
    position = {node: index for index, node in enumerate(graph.nodes)}
    wanted = _canonical_order(
        graph, collectives, key=lambda n: (-n.meta["seq_nr"] if backward else n.meta["seq_nr"], position[n])
    )
    if wanted == collectives:
        return
    after = {later: earlier for earlier, later in zip(wanted, wanted[1:])}
    pending = {node: len(set(node.all_input_nodes)) + (node in after) for node in graph.nodes}
    waiting: dict[fx.Node, list[fx.Node]] = {node: [] for node in graph.nodes}
    for node in graph.nodes:
        for source in set(node.all_input_nodes):
            waiting[source].append(node)
        if node in after:
            waiting[after[node]].append(node)
    ready = [(position[node], node) for node in graph.nodes if pending[node] == 0]
    order: list[fx.Node] = []
    while ready:  # Kahn's algorithm, earliest original position first
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in waiting[node]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, (position[user], user))
    if len(order) != len(position):  # the canonical order contradicts a data dependency: keep the graph's
        return
    last = order[0]
    for node in order[1:]:
        last.append(node)
        last = node


def _canonical_order(graph: fx.Graph, collectives: list[fx.Node], key: Callable) -> list[fx.Node]:
    """The collectives by ``key``, except that one computed from another comes after it.

    Sorting by ``key`` alone can contradict the data: a collective that backward re-runs (Note [Layers
    that recompute attention] in ``memory_policy.py``) keeps its forward op's ``seq_nr``, and in a
    backward the attention output's all-to-all (a later forward op) is rebuilt from the q/k/v
    all-to-all (an earlier one). So the order is the topological order of the collectives' dependencies
    that takes the smallest key whenever several are ready; where sorting agrees with the data, the two
    orders are the same.
    """
    bit = {node: 1 << index for index, node in enumerate(collectives)}
    upstream: dict[fx.Node, int] = {}  # the collectives each node is computed from, as bits
    for node in graph.nodes:
        mask = 0
        for source in node.all_input_nodes:
            mask |= upstream[source] | bit.get(source, 0)
        upstream[node] = mask
    pending = {node: upstream[node] for node in collectives}
    ready = [(key(node), index, node) for index, node in enumerate(collectives) if not pending[node]]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for index, other in enumerate(collectives):
            if pending[other] & bit[node]:
                pending[other] &= ~bit[node]
                if not pending[other]:
                    heapq.heappush(ready, (key(other), index, other))
    return order


def collectives_in_order(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` that talk to other ranks (not the waits on them), in graph order."""
    return [node for node in graph.nodes if is_collective(node, waits=False)]


class CollectiveOrder(CustomGraphPass):
    """Inductor post-grad pass: each collective waits for the one before it (Note [Collective order])."""

    def __call__(self, graph: fx.Graph) -> None:
        collectives = collectives_in_order(graph)
        if len(collectives) < 2:
            return
        preserve_node_ordering(
            graph, {later: OrderedSet([earlier]) for earlier, later in zip(collectives, collectives[1:])}
        )

    def uuid(self) -> str:
        return hashlib.sha256(inspect.getsource(inspect.getmodule(CollectiveOrder)).encode()).hexdigest()
