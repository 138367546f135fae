"""The ranks of an sp group agree on what they compiled before any of it runs.

Note [Ranks agree on their graphs]
    Every rank traces its own shard, and shards may differ in length (61 tokens: 31 + 30). The graphs
    must still talk to each other collective by collective: the same all-to-alls, all-reduces and
    gathers, in the same order, over the same groups. A model that branches on the local length, a
    data-dependent graph break, or a refusal that only one rank's length triggers (a size that is 1 on
    the shorter shard) would otherwise leave ranks in different collectives: a hang, or tensors of one
    shape swapped for another.

    So after the SP pass, before the graph is compiled or run, the ranks of the sp group all-gather a
    short signature of the graph: its collectives in order (op, group, rank and dtype of each operand,
    lengths left out) and the rewrites applied, or the refusal. A refusal on any rank becomes the
    same error on every rank; different signatures raise, naming the first difference. One small
    all-gather per compiled graph, at compile time only.

    Where one graph serves every length of a class (Note [One graph for every length] in symbols.py),
    the ranks must also recompile at the same lengths: each rank's guards are on its own shard length,
    and a rewrite may branch on this rank's bounds only. So after compiling, the ranks exchange their
    guards as conditions on the global length and each installs all of them (``share_length_guards``
    in backend.py); a graph one rank compiled for its length only is compiled so on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx

from lightning_autosp.compiler.fx_utils import example_value
from lightning_autosp.compiler.prove.plan import LengthBranchRefusal, SequenceParallelRefusal
from lightning_autosp.compiler.runtime.ops import collective_name, is_collective, process_group


@dataclass(frozen=True)
class Outcome:
    """What one rank's SP pass made of a graph: its signature, or the error it raised."""

    signature: tuple[str, ...] = ()
    error: str | None = None
    error_type: str = "NotImplementedError"


def graph_signature(gm: fx.GraphModule, rewrites: list[str], groups: dict[str, str]) -> tuple[str, ...]:
    """The collectives of ``gm`` in order and the rewrites that talk to other ranks, lengths left out.
    ``groups`` names each process group by its role ("sp", "ring", ...): the ranks of an sp group sit in
    different ring and Ulysses groups, whose names differ."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_collective(node):
            continue
        operands = []
        for arg in node.args:
            value = example_value(arg)
            if value is not None:
                operands.append(f"{value.dtype}[{value.dim()}]")
            elif isinstance(arg, str):
                operands.append(groups.get(arg, arg))  # the group, by role
        lines.append(f"{collective_name(node.target)}({', '.join(operands)})")
    # Node names are the same on every rank (one trace structure); lengths in them are not.
    lines += [re.sub(r"\d+", "#", line) for line in rewrites]
    return tuple(lines)


def agree(outcome: Outcome, group_name: str) -> None:
    """All-gather ``outcome`` over the sp group; raise the same error on every rank if any rank failed
    or the signatures differ (Note [Ranks agree on their graphs]). No-op without a process group."""
    group = process_group(group_name)
    if group is None or dist.get_world_size(group) == 1:
        if outcome.error is not None:
            raise _error(outcome.error_type, outcome.error)
        return
    outcomes: list[Outcome | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.error is not None]
    if failed:
        rank, first = failed[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        raise _error(
            first.error_type,
            f"{first.error}\n(refused on sp rank(s) {ranks} of {len(outcomes)}; every rank stops here.)",
        )
    reference = outcomes[0].signature
    for rank, other in enumerate(outcomes[1:], start=1):
        if other.signature != reference:
            raise RuntimeError(_difference(reference, other.signature, rank))


def gather(value: object, group_name: str) -> list[object]:
    """Every sp rank's ``value`` (picklable), in rank order; ``[value]`` without a process group."""
    group = process_group(group_name)
    if group is None or dist.get_world_size(group) == 1:
        return [value]
    values: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _difference(first: tuple[str, ...], other: tuple[str, ...], rank: int) -> str:
    index = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
    mine = first[index] if index < len(first) else "(nothing)"
    theirs = other[index] if index < len(other) else "(nothing)"
    return (
        "The ranks of the sp group compiled different graphs, so their collectives would not match (a "
        f"hang, or tensors swapped between ranks). First difference, entry {index}: sp rank 0 has {mine!r}, "
        f"sp rank {rank} has {theirs!r}. Typical cause: code that depends on which rank runs it "
        "(torch.distributed.get_rank(), trainer.global_rank, a per-rank file or environment variable); "
        "branches on the sequence length or on token data are made global or refused by the SP pass. "
        "Make the step's control flow the same on every rank of the sp group."
    )


def _error(error_type: str, message: str) -> Exception:
    """The error every rank raises: a configuration error as itself, anything the pass could not prove as a
    refusal (the type steps.py hands to the user without Dynamo's wrapper)."""
    known = {error.__name__: error for error in (ValueError, RuntimeError, LengthBranchRefusal)}
    return known.get(error_type, SequenceParallelRefusal)(message)
