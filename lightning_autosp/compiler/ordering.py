"""Every rank runs the collectives of a compiled graph in one order: the order of the graph.

Note [Collective order]
    Ranks whose shards differ in length (61 tokens over 2 ranks: 31 + 30) compile graphs of different
    sizes, and Inductor's scheduler may order independent nodes differently for different sizes. Two
    collectives with no data dependency between them then run in different orders on different
    ranks: in attention's backward the all-to-alls of dq, dk and dv are independent, and one rank
    sent dq while the other sent dv. The shapes agree, so nothing failed; every gradient upstream of
    that attention was silently wrong (a GPT at 61 tokens, batch 1, Inductor: relative error 1.2).

    AOTAutograd traces the forward and backward graphs in an order that depends on the graph's
    structure only, which every rank shares. This post-grad pass chains the collectives of each graph
    Inductor compiles in that order with Inductor's control dependencies, so the scheduler cannot
    swap them. ``aot_eager`` runs graphs in their order already.
"""

from __future__ import annotations

import hashlib
import inspect

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from lightning_autosp.compiler.ops import is_collective


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
