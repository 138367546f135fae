"""Activation offload (Note [Activation offload]): saved values round-trip through host memory exactly."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.partition.offload import Offload, wait_one_copy_later
from lightning_autosp.compiler.sp_pass import SPContext
from lightning_autosp.data import SequenceShard
from tests.unit.test_sac import RecordingPartitioner, _assert_same, _ids, _module, _step

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _copies(graph_module: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in graph_module.graph.nodes
        if n.op == "call_function" and str(n.target) == "prims.device_put.default"
    ]


def _saved(forward: fx.GraphModule) -> list[fx.Node]:
    (output,) = forward.graph.find_nodes(op="output")
    return [n for n in output.args[0] if isinstance(n, fx.Node) and n.op != "placeholder"]


class _KeepingPartitioner(RecordingPartitioner):
    """Keeps the partitioned graphs too."""

    def __init__(self, **options) -> None:
        super().__init__()
        for name, value in options.items():
            setattr(self, name, value)
        self.graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []

    def __call__(self, gm, joint_inputs, **kwargs):
        forward, backward = super().__call__(gm, joint_inputs, **kwargs)
        self.graphs.append((forward, backward))
        return forward, backward


@pytest.mark.parametrize("sac", [True, "longest"])
def test_saved_values_round_trip_through_host_memory_exactly(gloo_group: str, sac) -> None:
    """Every saved activation is copied out after its last forward use and back before backward reads it;
    loss and gradients are bit-identical to keeping them, and the report counts what moved."""
    module, ids = _module(), _ids()
    context = SPContext(SequenceShard.balanced(ids.shape[1], 1, 0), gloo_group)
    results, reports = {}, {}
    for offload in (False, True):
        backend = AutoSPBackend(context, compiler="aot_eager", sac=sac, offload_activations=offload)
        backend.partitioner = _KeepingPartitioner(mode=backend.partitioner.mode, offload_activations=offload)
        results[offload] = _step(module, backend, ids)
        (reports[offload],) = backend.sac_reports
        graphs = backend.partitioner.graphs
    _assert_same(results[True], results[False], rtol=0)
    _assert_same(results[True], _step(module, None, ids), rtol=1e-5)

    kept, moved = reports[False], reports[True]
    assert kept.offloaded is None and moved.offloaded is not None
    assert moved.saved_bytes == kept.saved_bytes and moved.recomputed_ops == kept.recomputed_ops
    # each saved activation that is not a view moved, and came back once
    ((forward, backward),) = graphs
    assert moved.offloaded.values == len(_copies(forward)) == len(_copies(backward)) > 0
    assert 0 < moved.offloaded.bytes <= moved.saved_bytes
    # what stayed is what torch never moves: scalars, and the random-number state of attention's rebuild
    stayed = [n for n in _saved(forward) if n not in _copies(forward)]
    assert all(n.target is operator.getitem or n.meta["val"].dim() == 0 for n in stayed), stayed
    assert "kept in host memory until backward" in moved.line()


def test_offload_option_is_checked() -> None:
    with pytest.raises(TypeError, match="offload_activations='yes' must be True or False"):
        AutoSPBackend(None, compiler="aot_eager", offload_activations="yes")


@pytest.mark.inductor
def test_inductor_compiles_the_copies_and_keeps_the_gradients(gloo_group: str) -> None:
    """ALST's recipe as one option pair: every layer rebuilt in backward, its input in host memory."""
    module, ids = _module(), _ids(17)
    context = SPContext(SequenceShard.balanced(ids.shape[1], 1, 0), gloo_group)
    backend = AutoSPBackend(context, compiler="inductor", sac="longest", offload_activations=True)
    _assert_same(_step(module, backend, ids), _step(module, None, ids), rtol=1e-5)
    (report,) = backend.sac_reports
    assert report.offloaded is not None and report.offloaded.bytes > 0
    assert report.attention_recompute is not None and report.attention_recompute.chosen == (0, 1)


def test_each_wait_for_a_copy_to_host_moves_past_the_next_copy() -> None:
    """Note [Waiting for a copy to host]: on an accelerator a layer's saved value is copied while the next
    layer computes; the graph holds torch's asynchronous copy ops (built here without a GPU)."""
    from torch._functorch._activation_offloading import offload_ops  # noqa: F401 (registers ao::)

    graph = fx.Graph()
    x = graph.placeholder("x")
    waits = []
    for _ in range(3):
        x = graph.call_function(torch.ops.aten.sin.default, (x,))
        copy = graph.call_function(torch.ops.ao.offload.default, (x,))
        waits.append(graph.call_function(torch.ops.ao.wait_tensor.default, (copy, x)))
    graph.output((x, *waits))
    forward = fx.GraphModule(torch.nn.Module(), graph)

    assert wait_one_copy_later(forward) == 2
    order = [str(n.target).split(".")[1] if n.op == "call_function" else n.op for n in forward.graph.nodes]
    # sin, copy, sin, copy, wait(first), sin, copy, wait(second), wait(third)
    assert order == ["placeholder", "sin", "offload", "sin", "offload", "wait_tensor", "sin", "offload"] + [
        "wait_tensor",
        "wait_tensor",
        "output",
    ]


def test_offload_composes_with_row_tiling(gloo_group: str) -> None:
    """Row tiling (Note [Row tiling]) rewrites the partitioned graphs after the copies are in: every region
    tiled (sac_tile_bytes=0), the saved values still round-trip exactly."""
    module, ids = _module(), _ids(19)[:1]  # tiling takes one sequence a batch
    context = SPContext(SequenceShard.balanced(ids.shape[1], 1, 0), gloo_group)
    backend = AutoSPBackend(
        context, compiler="aot_eager", sac="longest", sac_tile_bytes=0, offload_activations=True
    )
    _assert_same(_step(module, backend, ids), _step(module, None, ids), rtol=1e-5)
    (report,) = backend.sac_reports
    assert report.tiled_regions > 0 and report.offloaded is not None and report.offloaded.values > 0


def test_the_report_line_counts_values_in_words() -> None:
    # docs/how-it-works.md quotes the parity run's line, which moved one value
    assert "(1 value) kept in host memory" in Offload(1, 4096).line()
    assert "(2 values) kept in host memory" in Offload(2, 8192).line()
