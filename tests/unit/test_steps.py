"""Compiled steps and Dynamo's recompile limits (``lightning_autosp/steps.py``): every length class (or,
where a graph needs the number, every length) is a Dynamo region of its own, and a step that keeps
recompiling within one region stops with the guard that failed, before it runs eagerly outside the SP
pass."""

from __future__ import annotations

import collections
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.prove.plan import LengthBranchRefusal, SequenceParallelRefusal
from lightning_autosp.data import SequenceShard
from lightning_autosp.steps import (
    RECOMPILES_PER_LAYOUT,
    CompiledSteps,
    EagerEvidence,
    check_sequence_parallel_applied,
)


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
        evidence = EagerEvidence(1, breaks, eager_calls=["mul on a tensor of layout shard(0) at x.py:2"])
        check_sequence_parallel_applied("training_step", backend, evidence)
    assert "graph break in loop" in str(error.value)
    assert "frame skipped: _prints_in_a_loop" in str(error.value)


class _OneLengthBackend:
    """A stand-in backend whose graphs serve one length only (as the SP pass reports for a rewrite that
    fixed the length): the step must then compile per length instead of per length class."""

    def __init__(self, context: object) -> None:
        self.context, self.reports, self.sac_reports, self.loss_reports = context, [], [], []
        self.tags = SequenceTags()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        why = "compiling it fixed the length (Eq(s0, 5))"
        self.reports.append(
            SimpleNamespace(one_length=why, lines=lambda: [f"this length only: {why}"], length_outputs=[])
        )
        return gm.forward


def test_lengths_of_one_class_share_a_graph_unless_a_rewrite_fixed_the_length() -> None:
    torch._dynamo.reset()
    current: list[SequenceShard] = []
    steps = CompiledSteps(_OneLengthBackend, lambda shard: SimpleNamespace(shard=shard), lambda: current[-1])
    model = Model()
    step = steps.compiled("training_step", model.training_step)
    for length in (9, 11):  # the same class (odd over 2 ranks), so one region; its graph serves 9 only
        current.append(SequenceShard.balanced(length, 2, 0))
        step(torch.randn(2, 4), 0)
    nine, eleven = current
    assert steps.compiles == {("training_step", nine.length_class): 1, ("training_step", eleven): 1}
    assert "training_step: one graph per length, because compiling it fixed the length" in steps.explain()


def test_length_classes_of_the_balanced_layout() -> None:
    assert SequenceShard.balanced(9, 2, 0).length_class == SequenceShard.balanced(31, 2, 1).length_class
    assert SequenceShard.balanced(9, 2, 0).length_class != SequenceShard.balanced(10, 2, 0).length_class
    assert str(SequenceShard.balanced(10, 4, 3).length_class) == "every length = 2 mod 4"
    assert SequenceShard.for_ring(16, 4, 0, ring_degree=2).length_class is None  # zigzag: per length


class RefusingBackend(AutoSPBackend):
    """A backend whose pass refuses every graph, as the SP pass refuses one it cannot prove exact."""

    def __call__(self, gm, example_inputs):
        raise SequenceParallelRefusal(
            "The SP pass cannot prove this training step exact:\n- sort at model.py:3"
        )


def test_a_refusal_reaches_the_user_as_itself_and_each_compile_is_announced(caplog) -> None:
    """Dynamo wraps a backend's error in BackendCompilerFailed with advice on its own logging: a refusal is
    raised as the project's own exception, its message first; and rank 0 says what compiles and how long
    it took (the first step's cost is otherwise a silent wait)."""
    model, steps = _compiled_steps()
    step = steps.compiled("training_step", model.training_step)
    with caplog.at_level(logging.INFO):
        step(torch.randn(2, 4), 0)
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("AutoSP: compiling training_step") for m in messages), messages
    assert any(re.match(r"AutoSP: compiled training_step \(.*\) in [\d.]+ s", m) for m in messages), messages
    torch._dynamo.reset()
    steps = CompiledSteps(
        lambda _: RefusingBackend(None, compiler="aot_eager"), lambda shard: None, lambda: None
    )
    step = steps.compiled("training_step", model.training_step)
    with pytest.raises(SequenceParallelRefusal) as refusal:
        step(torch.randn(2, 4), 0)
    assert str(refusal.value).startswith("The SP pass cannot prove") and "TORCHDYNAMO" not in str(
        refusal.value
    )
    assert refusal.value.__cause__ is None and refusal.value.__suppress_context__


class LengthBranchingBackend(AutoSPBackend):
    """A backend whose pass refuses a graph traced at a shard's length (2 rows) for a branch on it, and
    takes the one traced at the whole sequence's (4 rows)."""

    def __call__(self, gm, example_inputs):
        if any(isinstance(x, torch.Tensor) and x.shape == (2, 4) for x in example_inputs):
            raise LengthBranchRefusal("The SP pass cannot prove this training step exact:\n- branched")
        return super().__call__(gm, example_inputs)


def test_a_step_that_branches_on_the_shards_length_runs_again_on_the_whole_batch(caplog) -> None:
    """trace_length="auto" (Note [Tracing at the whole sequence's length]): the strategy hands over the batch
    whole once, and the step's result is that of the whole batch; with "shard" there is none to hand over
    and the refusal is the user's."""
    torch._dynamo.reset()
    model, whole, handed = Model(), torch.randn(4, 4), []
    steps = CompiledSteps(
        lambda _: LengthBranchingBackend(None, compiler="aot_eager"),
        lambda shard: None,
        lambda: None,
        lambda: handed.append(whole) or whole,
    )
    with caplog.at_level(logging.INFO):
        loss = steps.compiled("training_step", model.training_step)(torch.randn(2, 4), 0)
    assert len(handed) == 1
    torch.testing.assert_close(loss, model.training_step(whole, 0))
    messages = [record.getMessage() for record in caplog.records]
    assert any("branches on the sequence length; tracing it at the whole length" in m for m in messages)
    torch._dynamo.reset()
    steps = CompiledSteps(
        lambda _: LengthBranchingBackend(None, compiler="aot_eager"), lambda shard: None, lambda: None
    )
    with pytest.raises(LengthBranchRefusal):
        steps.compiled("training_step", model.training_step)(torch.randn(2, 4), 0)


class BrokenModel(Model):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        hidden = self.linear(batch)
        torch._dynamo.graph_break()  # as an FSDP unit's hooks or an unsupported call break the step
        return hidden.sum()


def test_a_step_broken_into_graphs_keeps_its_refusal_for_a_branch_on_the_length() -> None:
    """Eager code between the graphs holds this rank's part of the values, which a whole batch's next graph
    would not match: no second trace, and the refusal says why."""
    torch._dynamo.reset()
    handed = []
    steps = CompiledSteps(
        lambda _: LengthBranchingBackend(None, compiler="aot_eager"),
        lambda shard: None,
        lambda: None,
        lambda: handed.append(True) or torch.randn(4, 4),
    )
    with pytest.raises(LengthBranchRefusal, match="Not traced again at the whole sequence's length"):
        steps.compiled("training_step", BrokenModel().training_step)(torch.randn(2, 4), 0)
    assert not handed
