"""Row tiling (Note [Row tiling]): the rebuilt MLPs run over tiles of tokens, with the same numbers."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.partition.sac import SequenceAwarePartitioner
from tests.distributed.modules import VOCAB, LlamaModule, TinyGPT

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LENGTH = 96


class RecordingPartitioner(SequenceAwarePartitioner):
    """Keeps the partitioned backward graphs."""

    def __init__(self, tile_bytes: int | None) -> None:
        super().__init__("all", tile_bytes=tile_bytes)
        self.backwards: list[fx.GraphModule] = []

    def __call__(self, gm, joint_inputs, **kwargs):
        forward, backward = super().__call__(gm, joint_inputs, **kwargs)
        self.backwards.append(backward)
        return forward, backward


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt":
        model = TinyGPT(layers=2)
        return model, lambda ids: model(ids).logsumexp(-1).mean()
    model = LlamaModule(layers=2).model  # HF Llama from its default config, sizes changed
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def _ids(length: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))


def _run(model, loss_fn, step, ids):
    model.zero_grad(set_to_none=True)
    loss = step(ids)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _compiled(loss_fn, tile_bytes: int | None, dynamic: bool = False):
    backend = AutoSPBackend(None, compiler="aot_eager", sac=True, sac_tile_bytes=tile_bytes)
    backend.partitioner = RecordingPartitioner(tile_bytes)
    return backend, torch.compile(loss_fn, backend=backend, dynamic=dynamic)


def _assert_close(a, b) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=0)
    floor = max(g.abs().max() for g in grads_b)
    for grad_a, grad_b in zip(grads_a, grads_b):
        torch.testing.assert_close(grad_a, grad_b, rtol=1e-4, atol=1e-4 * floor)


def _widest_rebuilt(backward: fx.GraphModule) -> int:
    """Elements of the largest value backward computes (not the saved ones it is handed)."""
    sizes = [
        n.meta["val"].numel()
        for n in backward.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    return max(sizes)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tiled_rebuild_gives_the_same_loss_and_gradients(family: str) -> None:
    model, loss_fn = _model(family)
    ids = _ids()
    eager = _run(model, loss_fn, loss_fn, ids)
    tiled_backend, tiled = _compiled(loss_fn, tile_bytes=0)
    whole_backend, whole = _compiled(loss_fn, tile_bytes=None)
    _assert_close(_run(model, loss_fn, tiled, ids), eager)
    _assert_close(_run(model, loss_fn, whole, ids), eager)

    (report,) = tiled_backend.sac_reports
    (untiled,) = whole_backend.sac_reports
    assert untiled.tiled_regions == 0 and report.tiled_regions >= 3, report.line()
    assert f"{report.tiled_regions} row-wise regions run in up to" in report.line()
    if family == "llama":
        # Every block's MLP is rebuilt tile by tile (the final norm's input is saved, so the last block
        # is rebuilt like the others): backward never holds a [S, intermediate] value whole.
        intermediate = model.config.intermediate_size
        (backward,) = tiled_backend.partitioner.backwards
        (control,) = whole_backend.partitioner.backwards
        assert _widest_rebuilt(control) >= LENGTH * intermediate
        assert _widest_rebuilt(backward) < LENGTH * intermediate


def test_tiling_serves_every_length_of_a_symbolic_graph() -> None:
    """One graph with a symbolic length tiles with bounds computed from it, exact at each length; a
    length too short for non-empty tiles compiles again."""
    model, loss_fn = _model("gpt")
    backend, step = _compiled(loss_fn, tile_bytes=0, dynamic=True)
    for length in (LENGTH, 61, 40):
        ids = _ids(length)
        _assert_close(_run(model, loss_fn, step, ids), _run(model, loss_fn, loss_fn, ids))
    (report,) = backend.sac_reports  # one compile served every length
    assert report.tiled_regions >= 1
    (backward,) = backend.partitioner.backwards
    bounds = [n for n in backward.graph.nodes if n.target is operator.floordiv]  # (k * S) // tiles
    assert bounds and all(isinstance(n.meta["val"], torch.SymInt) for n in bounds)
    ids = _ids(5)
    _assert_close(_run(model, loss_fn, step, ids), _run(model, loss_fn, loss_fn, ids))
    assert len(backend.sac_reports) == 2


def test_tiling_threshold_is_checked() -> None:
    with pytest.raises(ValueError, match="sac_tile_bytes=-1 must be a number of bytes"):
        AutoSPBackend(None, sac_tile_bytes=-1)


def test_16_bit_matmuls_get_no_tile_under_half_the_threshold() -> None:
    """Note [Row tiling]: a bf16 GEMM pays a fixed cost per call that narrow tiles would multiply, so its
    regions run in fewer, wider tiles than the width of their edges asks; fp32 regions as many as asked."""
    model, loss_fn = _model("gpt")
    ids = _ids()
    tiles = {}
    for dtype, tile_bytes in ((torch.float32, 16 << 10), (torch.bfloat16, 16 << 10), (torch.bfloat16, 0)):
        backend, step = _compiled(loss_fn, tile_bytes=tile_bytes)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            _run(model, loss_fn, step, ids)
        (report,) = backend.sac_reports
        tiles[dtype, tile_bytes] = report.tiles
    assert tiles[torch.float32, 16 << 10] == 8
    assert 2 <= tiles[torch.bfloat16, 16 << 10] < tiles[torch.bfloat16, 0]
