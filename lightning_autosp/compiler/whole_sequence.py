"""Steps traced at the whole sequence's length, run on this rank's part of it.

Note [Tracing at the whole sequence's length]
    Dynamo runs the step's Python once, while tracing, and every Python computation on a length (a pad
    to whole chunks, a loop over them, ``if x.size(1) > n``) is fixed then at the length it saw. Traced
    on a rank's shard, that is the shard's length, and where the model's branches differ at the whole
    sequence's the pass can only refuse (Note [Symbolic sequence lengths] in ``symbols.py``). So the
    batch may instead enter the compiled step whole: Dynamo traces it at the global length G, and every
    branch is the one a single device takes. ``AutoSPStrategy(trace_length="whole")`` does so from the
    first step; the default, ``"auto"``, after a step's shard trace is refused for such a branch
    (``LengthBranchRefusal``, which every rank raises alike): ``CompiledSteps`` calls the step again
    with the batch whole, and the strategy hands over whole batches from then on. Not a step broken into
    several graphs: the eager code between them (an FSDP unit's hooks, a skipped frame) holds this rank's
    part of the values, which the next graph's whole inputs would not match, so it keeps the refusal.

    The graph is the same kind of object either way: the single-device program as a function of a
    length symbol s, valid where its shape guards hold. The analysis reads every size as an expression
    of s and the global length as the value s takes for the whole sequence (Note [Proving a graph
    exact] in ``analysis.py``); only the traced value of s differs (G here, the shard's length there).
    So the same proof and the same rewrites give each rank's program. What changes is around it:

    - the rewritten graph takes this rank's part of the sequence, so the compiled callable cuts each
      whole input to this rank's part on entry (``taking_shards``), and the length Dynamo passes as a
      graph input becomes this rank's;
    - Dynamo's example inputs have the whole length, so the rewritten graph is compiled on fake inputs
      of this rank's shapes (``local_example_inputs``), whose sizes are numbers;
    - hence one graph per length: the pass fixes the symbol to G (a guard on the step's inputs, which
      are whole), and the compiled code to this rank's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import calling_like
from lightning_autosp.data import SequenceShard


@dataclass(frozen=True)
class WholeInput:
    """A graph input holding the whole sequence along ``dim``; ``index`` among the graph's inputs."""

    index: int
    dim: int


@dataclass(frozen=True)
class WholeLengths:
    """The graph inputs that hold the whole sequence, and those that are its length (a SymInt input)."""

    tensors: tuple[WholeInput, ...]
    lengths: tuple[int, ...]  # indices of inputs whose value is the whole length


def whole_lengths(input_tags: dict[Any, Any], example_inputs: Sequence[object]) -> WholeLengths | None:
    """The whole inputs of a graph, from its inputs' tags (``Analysis.input_tags``: placeholder -> tag,
    in input order), or None if every input is already this rank's part."""
    tensors, symbols_of_whole = [], set()
    for node, tag in input_tags.items():
        if not tag.whole:
            continue
        graph_inputs = [n for n in node.graph.nodes if n.op == "placeholder"]
        assert len(graph_inputs) == len(example_inputs), "one example input per graph input"
        index = graph_inputs.index(node)
        for dim in tag.layout.dims:
            tensors.append(WholeInput(index, dim))
            value = example_inputs[index]
            if isinstance(value, torch.Tensor):
                symbols_of_whole |= symbols.symbols_of(symbols.raw_expr(value.shape[dim]))
    if not tensors:
        return None
    lengths = tuple(
        index
        for index, value in enumerate(example_inputs)
        if isinstance(value, torch.SymInt) and symbols.raw_expr(value) in symbols_of_whole
    )
    return WholeLengths(tuple(tensors), lengths)


def local_example_inputs(
    example_inputs: Sequence[object], whole: WholeLengths, shard: SequenceShard
) -> list[object]:
    """Dynamo's example inputs with each whole input as a fake of this rank's part (its sizes numbers) and
    each whole length as this rank's."""
    local = list(example_inputs)
    for index in whole.lengths:
        local[index] = shard.local_len
    dims: dict[int, set[int]] = {}
    for entry in whole.tensors:
        dims.setdefault(entry.index, set()).add(entry.dim)
    mode = _fake_mode(example_inputs)
    for index, sequence_dims in dims.items():
        value = example_inputs[index]
        shape = [symbols.concrete(size) for size in value.shape]
        for dim in sequence_dims:
            shape[dim] = shard.local_len
        with mode:
            fake = torch.empty(shape, dtype=value.dtype, device=value.device)
        local[index] = fake.requires_grad_(value.requires_grad)
    return local


def _fake_mode(example_inputs: Sequence[object]) -> FakeTensorMode:
    """The fake mode the compile traces in: the example inputs' (Dynamo hands real tensors), Dynamo's, or a
    new one. AOTAutograd takes a fake input as it is, so the local sizes stay numbers."""
    mode = next((v.fake_mode for v in example_inputs if isinstance(v, FakeTensor)), None)
    context = torch._guards.TracingContext.try_get()
    return mode or getattr(context, "fake_mode", None) or FakeTensorMode()


def taking_shards(compiled: Callable, whole: WholeLengths, shard: SequenceShard) -> Callable:
    """``compiled`` (this rank's program) called with the step's whole inputs: each cut to this rank's part
    on entry, and each whole length made this rank's."""
    boxed = getattr(compiled, "_boxed_call", False)

    def local(args: Sequence[Any]) -> list[Any]:
        args = list(args)
        for entry in whole.tensors:
            args[entry.index] = shard.take(args[entry.index], entry.dim).contiguous()
        for index in whole.lengths:
            args[index] = shard.local_len
        return args

    def run(*args: Any) -> Any:
        if boxed and len(args) == 1 and isinstance(args[0], list):  # Dynamo's boxed call: one list
            cut = local(args[0])
            args[0].clear()  # the boxed convention: the callee owns (and frees) its inputs
            return compiled(cut)
        return compiled(*local(args))

    return calling_like(compiled, run)
