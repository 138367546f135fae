"""What a sharded step runs outside its compiled graphs (Note [Eager code between graphs] in
``compiler/runtime/eager_watch.py``): torch calls on sequence data are recorded with their line, the rest
(replicated values, the compiled graphs' own ops, Dynamo's reads of their inputs' sizes) is not; a graph
that hands eager code a length says so."""

from __future__ import annotations

import inspect

import torch

from lightning_autosp.compiler.prove.layout import REPLICATE, SequenceTags, Tag, shard
from lightning_autosp.compiler.runtime.eager_watch import (
    EagerWatch,
    graph_breaks_inside_the_watch,
    running_compiled,
)
from lightning_autosp.data import SequenceShard
from tests.unit.sp_graphs import pass_on


@torch.compiler.disable
def _mean_over_tokens(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.mean(1)  # eager: this rank's tokens only


@torch.compiler.disable
def _scaled(loss: torch.Tensor) -> float:
    return loss.item() * 2  # eager, on a replicated value: what one device computes


def _step(tokens: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    hidden = tokens * 2  # inside the compiled graph
    return _mean_over_tokens(tokens).sum() + hidden.sum() + _scaled(loss)


def _compiled_graphs(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    return running_compiled(gm.forward)  # as AutoSPBackend marks the graphs it compiles


def test_eager_calls_on_sequence_data_are_recorded_with_their_line() -> None:
    tags = SequenceTags()
    tokens, loss = torch.randn(2, 6, 4), torch.tensor(1.5)
    tags.mark(tokens, Tag(shard(1), (12,)))  # this rank's 6 of 12 tokens; the dim traced as a symbol
    tags.mark(loss, Tag(REPLICATE))
    torch._dynamo.reset()
    step = torch.compile(_step, backend=_compiled_graphs, dynamic=False)
    for _ in range(2):  # compiling, then running what was compiled
        watch = EagerWatch(tags)
        with watch:
            step(tokens, loss)
        line = inspect.getsourcelines(_mean_over_tokens)[1] + 2
        assert watch.calls == [
            f"mean on a tensor of layout shard(1) at {__file__}:{line} in _mean_over_tokens"
        ], watch.calls


def test_a_replicated_step_leaves_nothing_to_record() -> None:
    tags = SequenceTags()
    tokens, loss = torch.randn(2, 6, 4), torch.tensor(1.5)
    tags.mark(tokens, Tag(REPLICATE))
    torch._dynamo.reset()
    watch = EagerWatch(tags)
    with watch:
        torch.compile(_step, backend=_compiled_graphs, dynamic=False)(tokens, loss)
    assert watch.calls == []


def test_a_graph_that_hands_on_a_length_reports_it() -> None:
    def step(tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        return tokens.sum(), tokens.size(1)

    _, report, _ = pass_on(step, SequenceShard.balanced(12, 2, 0), torch.randn(2, 6), sharded={0: 1})
    assert len(report.length_outputs) == 1, report.length_outputs
    _, report, _ = pass_on(lambda tokens: tokens.sum(), SequenceShard.balanced(12, 2, 0), torch.randn(2, 6))
    assert report.length_outputs == []


@torch.compiler.disable
def _eager_helper(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _breaking_step(x: torch.Tensor) -> torch.Tensor:
    rows = (x * 2).tolist()  # a break on a torch call: it runs inside the watch's inlined function
    if x.sum() > 0:  # a branch on a value: the instruction runs in the step's own frame
        x = x + 1
    return _eager_helper(x) + torch.tensor(rows)  # a break on a call Dynamo does not trace


def test_graph_breaks_on_a_torch_call_are_told_apart() -> None:
    torch._dynamo.reset()
    with EagerWatch(SequenceTags()), graph_breaks_inside_the_watch() as inside:
        torch.compile(_breaking_step, backend=_compiled_graphs)(torch.ones(2, 3))
    assert len(inside) == 1 and "Tensor.tolist()" in inside[0], inside
