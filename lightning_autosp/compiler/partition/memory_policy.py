"""Layers that give up SAC's saved attention and rebuild it, all-to-alls included, in backward.

Note [Layers that recompute attention]
    SAC (``sac.py``) saves, per layer, what is costly to rebuild: attention's outputs (its output and
    logsumexp) and every collective's output (the all-to-alls to heads and back). At long lengths those
    are most of what a rank holds for backward: attention's output and the all-to-all outputs are each a
    full activation of the layer, for every layer at once.

    A layer can keep only its input instead (the block boundary SAC saves anyway) and rebuild the rest
    in backward, attention and its all-to-alls included: ALST's trade, applied per layer. For each layer
    that takes it, backward runs attention's forward once more and the layer's forward all-to-alls again
    (twice the forward's traffic in all), and the rank holds a layer's attention values only while that
    layer's backward runs. The result is the same: attention without dropout and the all-to-alls are
    deterministic, so the rebuilt values equal the saved ones bit for bit. Attention with dropout
    stays saved (a rebuild would draw another mask).

    What the user asks for picks how many layers take the trade: ``sac="longest"`` sends every layer;
    ``activation_budget=N`` sends layers, those freeing the most bytes per recomputed FLOP first, until
    the bytes SAC keeps for backward fit in N. The others keep SAC's saves and pay nothing more.
    ``explain()`` prints the choice: layers sent, bytes freed, FLOPs and collectives added.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from lightning_autosp.compiler.fx_utils import ancestors
from lightning_autosp.compiler.partition.parameter_gathers import is_parameter_all_gather
from lightning_autosp.compiler.partition.tiling_rules import node_bytes
from lightning_autosp.compiler.runtime.ops import is_collective


@dataclass(frozen=True)
class LayerSaves:
    """What SAC saves of one layer that the layer could rebuild instead."""

    index: int
    nodes: tuple[fx.Node, ...]  # attention ops and collectives tagged MUST_SAVE, with their getitems
    bytes: int
    flops: int  # the forward FLOPs a rebuild adds (attention's; the matmuls are rebuilt by SAC already)
    collectives: int  # collectives a rebuild runs again


@dataclass(frozen=True)
class AttentionRecompute:
    """The layers sent to rebuild attention and its collectives in backward (Note [Layers that
    recompute attention]), and what that costs."""

    budget: int | None  # None: every layer ("longest")
    layers: int
    chosen: tuple[int, ...]
    kept_bytes: int  # bytes tagged MUST_SAVE before the choice
    freed_bytes: int
    added_flops: int
    added_collectives: int

    def line(self) -> str:
        asked = "longest" if self.budget is None else f"budget {self.budget / 2**20:.2f} MiB"
        text = (
            f"{asked}: {len(self.chosen)} of {self.layers} layers rebuild attention and its collectives "
            f"in backward ({self.freed_bytes / 2**20:.2f} of {self.kept_bytes / 2**20:.2f} MiB saved "
            f"values freed; +{self.added_flops / 1e9:.3g} GFLOP, +{self.added_collectives} collectives)"
        )
        if self.budget is not None and self.kept_bytes - self.freed_bytes > self.budget:
            text += "; still over the budget with every layer sent"
        return text


def _saved(node: fx.Node) -> bool:
    return node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE


def _has_dropout(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    names = [argument.name for argument in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return False
    position = names.index("dropout_p")
    value = node.args[position] if position < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return value != 0.0


def _value_bytes(node: fx.Node) -> int:
    """Bytes a saved node holds: a multi-output op's are counted at its getitems."""
    if any(user.target is operator.getitem for user in node.users):
        return 0
    return node_bytes(node)


def layer_saves(
    forward: Sequence[fx.Node],
    boundaries: set[fx.Node],
    is_attention: Callable[[fx.Node], bool],
    flops: Callable[[fx.Node], int],
) -> list[LayerSaves]:
    """SAC's saved attention and collective values, grouped by the layer they belong to.

    ``forward`` in graph order; ``boundaries`` are the saved block inputs (``sac.layer_boundaries``),
    which cut it into layers. A stretch holding no attention (the embedding, the head) is not a layer.
    """
    layers = []
    for stretch in _stretches(forward, boundaries):
        attention = [n for n in stretch if is_attention(n) and _saved(n) and not _has_dropout(n)]
        if not attention:
            continue
        sent = set(attention) | {
            n for n in stretch if _saved(n) and is_collective(n) and not is_parameter_all_gather(n)
        }
        sent |= {n for n in stretch if n.target is operator.getitem and n.args[0] in sent}
        nodes = tuple(n for n in stretch if n in sent)
        layers.append(
            LayerSaves(
                index=len(layers),
                nodes=nodes,
                bytes=sum(_value_bytes(n) for n in nodes),
                flops=sum(flops(n) for n in attention),
                collectives=sum(1 for n in nodes if is_collective(n, waits=False)),
            )
        )
    return layers


def _stretches(forward: Sequence[fx.Node], boundaries: set[fx.Node]) -> list[list[fx.Node]]:
    """``forward`` cut after each saved block input: one stretch per layer, and the head's."""
    stretches: list[list[fx.Node]] = [[]]
    for node in forward:
        stretches[-1].append(node)
        if node in boundaries:
            stretches.append([])
    return stretches


def values_shared_by_layers(
    forward: Sequence[fx.Node], boundaries: set[fx.Node], is_attention: Callable[[fx.Node], bool]
) -> list[fx.Node]:
    """Values one stretch computes that a later layer's attention reads, besides the block inputs: the
    rotary tables every layer reads, a mask built once. Tensors no larger than a block input.

    A layer that rebuilds attention rebuilds its q and k from these. Left to recompute, they tie every
    layer's rebuild to the first stretch's, and the row tiling of backward (``tiling.py``) then joins all
    of the rebuilds into one region, run before the last layer's backward, each rebuilt q, k and v held
    until its own layer's: the layers' peaks added up instead of one layer's. Values read elsewhere (a
    weight's transpose that backward reads again) are not layers' and are left alone.
    """
    stretch_of = {
        node: index for index, stretch in enumerate(_stretches(forward, boundaries)) for node in stretch
    }
    read_by_attention: set[fx.Node] = set()
    for node in forward:
        if is_attention(node):
            read_by_attention |= ancestors(node)
    widest = max((node_bytes(node) for node in boundaries), default=0)
    return [
        node
        for node in forward
        if node.op == "call_function"
        and node not in boundaries
        and 0 < node_bytes(node) <= widest
        and any(user in read_by_attention and stretch_of[user] != stretch_of[node] for user in node.users)
    ]


def choose_layers(layers: Sequence[LayerSaves], kept_bytes: int, budget: int | None) -> AttentionRecompute:
    """The layers to send so that ``kept_bytes`` minus what they free fits ``budget`` (None: all),
    those freeing the most bytes per FLOP first."""
    order = sorted(layers, key=lambda layer: (layer.flops / max(layer.bytes, 1), layer.index))
    chosen: list[LayerSaves] = []
    for layer in order:
        if budget is not None and kept_bytes - sum(c.bytes for c in chosen) <= budget:
            break
        chosen.append(layer)
    return AttentionRecompute(
        budget=budget,
        layers=len(layers),
        chosen=tuple(sorted(layer.index for layer in chosen)),
        kept_bytes=kept_bytes,
        freed_bytes=sum(layer.bytes for layer in chosen),
        added_flops=sum(layer.flops for layer in chosen),
        added_collectives=sum(layer.collectives for layer in chosen),
    )


def send_layers(layers: Sequence[LayerSaves], choice: AttentionRecompute, shared: Sequence[fx.Node]) -> None:
    """Tag the chosen layers' saved attention and collectives ``MUST_RECOMPUTE``, and, when any layer is
    sent, the values layers share (``values_shared_by_layers``) ``MUST_SAVE``."""
    for layer in layers:
        if layer.index in choice.chosen:
            for node in layer.nodes:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    if choice.chosen:
        for node in shared:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def kept_bytes(forward: Sequence[fx.Node]) -> int:
    """Bytes of the forward values tagged ``MUST_SAVE``."""
    return sum(_value_bytes(n) for n in forward if _saved(n))
