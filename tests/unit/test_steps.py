"""Compiled steps and Dynamo's recompile limits (``lightning_autosp/steps.py``): every sequence layout is a
Dynamo region of its own, and a step that keeps recompiling within one layout stops with the guard that
failed, before it runs eagerly outside the SP pass."""

from __future__ import annotations

import collections

import pytest
import torch

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.steps import RECOMPILES_PER_LAYOUT, CompiledSteps, check_sequence_parallel_applied


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.linear(batch).sum()


def _compiled_steps() -> tuple[Model, CompiledSteps]:
    torch._dynamo.reset()
    model = Model()
    steps = CompiledSteps(
        lambda _: AutoSPBackend(None, compiler="aot_eager"), lambda shard: None, lambda: None
    )
    return model, steps


def test_each_compile_of_a_layout_is_counted_and_a_recompile_names_its_guard() -> None:
    model, steps = _compiled_steps()
    step = steps.compiled("training_step", model.training_step)
    step(torch.randn(2, 4), 0)
    step(torch.randn(2, 4), 1)
    assert steps.compiles == {("training_step", None): 1}
    step(torch.randn(3, 4), 2)  # a new batch size: the same layout, compiled again
    assert steps.compiles == {("training_step", None): 2}
    assert "training_step recompiled" in steps.explain()
    assert "size mismatch at index 0. expected 2, actual 3" in steps.explain()


def test_a_step_that_keeps_recompiling_stops_with_the_guard_not_an_eager_fallback() -> None:
    model, steps = _compiled_steps()
    step = steps.compiled("training_step", model.training_step)
    for batch_size in range(1, RECOMPILES_PER_LAYOUT + 1):
        step(torch.randn(batch_size, 4), batch_size)
    with pytest.raises(
        RuntimeError, match=r"recompiled 8 times .* each time because a guard failed"
    ) as error:
        step(torch.randn(RECOMPILES_PER_LAYOUT + 1, 4), 0)
    assert "size mismatch at index 0" in str(error.value)
    assert "drop_last=True" in str(error.value)


def _prints_in_a_loop(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = x * 2
        print("shape", x.shape)
    return x


def test_a_frame_left_to_eager_is_explained_by_dynamos_reason() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = collections.Counter(counters["unimplemented"])
    torch.compile(_prints_in_a_loop, backend="eager")(torch.randn(3))
    breaks = list(counters["unimplemented"] - before)
    backend = AutoSPBackend(None, compiler="aot_eager")
    with pytest.raises(
        RuntimeError, match=r"1 frame\(s\) fell back to eager: Failed to trace builtin"
    ) as error:
        check_sequence_parallel_applied("training_step", backend, 1, breaks)
    assert "graph break in loop" in str(error.value)
    assert "frame skipped: _prints_in_a_loop" in str(error.value)
