"""Note [Collective order]: the post-grad pass that keeps every rank's collectives in graph order."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_autosp.compiler.partition.ordering import CollectiveOrder, collectives_in_order
from lightning_autosp.compiler.runtime.ops import head_to_seq


def _three_independent_all_to_alls(dq, dk, dv):
    # The shape of attention's backward: three all-to-alls no data dependency orders.
    args = (1, 2, [3, 2], 0, "group")
    return [head_to_seq(t, *args) for t in (dq, dk, dv)]


def test_each_collective_waits_for_the_one_before_it() -> None:
    grads = [torch.randn(1, 2, 5, 4) for _ in range(3)]
    gm = make_fx(_three_independent_all_to_alls, tracing_mode="fake")(*grads)
    before = [node.name for node in collectives_in_order(gm.graph)]
    assert len(before) == 3  # the launches (all_to_all_single), not their waits
    assert all(name.startswith("all_to_all_single") for name in before)

    CollectiveOrder()(gm.graph)

    control_deps = torch.ops.higher_order.control_deps
    ordered = [node for node in gm.graph.nodes if node.target is control_deps]
    # Every collective but the first now takes the previous one as an explicit dependency.
    assert [node.name for node in ordered] == before[1:]
    assert [node.args[0][0].name for node in ordered] == before[:-1]
    gm.graph.lint()
