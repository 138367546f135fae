"""Read a Dynamo (Torch-IR) graph: attention calls, sequence-sharded values and their sequence dims.

The SP pass works on the graph Dynamo hands a backend, where attention is still one node and every
node carries ``meta["example_value"]`` (a fake tensor with this rank's local shapes). Nothing here
changes a graph.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.data import SequenceShard

_SDPA_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: (
        None
    )
)
_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
# Dynamo records ``F.pad`` as the builtin it calls.
PAD_TARGETS = (F.pad, torch._C._nn.pad)


@dataclass
class AttentionMatch:
    """One attention call. ``layout`` names the q/k/v dims: "BHSD" (SDPA) or "BSHD" (flash-attn)."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: fx.Node | None
    layout: str

    @property
    def head_dim(self) -> int:
        return self.layout.index("H")

    @property
    def seq_dim(self) -> int:
        return self.layout.index("S")


@dataclass(frozen=True)
class SeqLayout:
    """A value that holds this rank's shard of a sequence-derived tensor of ``global_len`` positions."""

    dim: int
    global_len: int


def example_value(node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def first_tensor_value(node: object) -> torch.Tensor | None:
    """The example value of a node, or of the first tensor of a tuple-valued node (split, chunk)."""
    value = example_value(node)
    if value is not None or not isinstance(node, fx.Node):
        return value
    items = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(items, (tuple, list)):
        return next((item for item in items if isinstance(item, torch.Tensor)), None)
    return None


def bind(node: fx.Node, signature: inspect.Signature) -> dict[str, object]:
    """The node's call arguments by parameter name, defaults filled in."""
    args = node.args[1:] if node.op == "call_method" else node.args
    bound = signature.bind(*args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def is_cross_entropy(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.cross_entropy


def find_attention(gm: fx.GraphModule) -> list[AttentionMatch]:
    """Every SDPA call in the graph, with its q/k/v/mask inputs."""
    matches = []
    for node in gm.graph.nodes:
        if is_sdpa(node):
            args = bind(node, _SDPA_SIGNATURE)
            matches.append(
                AttentionMatch(node, args["query"], args["key"], args["value"], args["attn_mask"], "BHSD")
            )
    return matches


def find_manual_attention(gm: fx.GraphModule, seq_len: int) -> list[fx.Node]:
    """Softmax over a [..., seq_len, seq_len] score matrix: attention written by hand."""
    found = []
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        value = example_value(node)
        is_square = value is not None and value.dim() >= 2 and tuple(value.shape[-2:]) == (seq_len, seq_len)
        if name in ("softmax", "_softmax") and is_square:
            found.append(node)
    return found


def is_parameter_input(node: fx.Node, example: object) -> bool:
    """Parameters and buffers lifted into the graph as inputs are replicated, never sharded."""
    if isinstance(example, torch.nn.Parameter):
        return True
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else str(name)  # a method before torch 2.10, a property since
    return "_parameters" in name or "_buffers" in name


def non_sequence_sizes(sharded: dict[fx.Node, SeqLayout]) -> set[int]:
    """Sizes of the sharded inputs' other dims (the batch size): a sequence length equal to one of
    them cannot be told apart from it by value."""
    return {
        size
        for node, layout in sharded.items()
        for dim, size in enumerate(example_value(node).shape)
        if dim != layout.dim
    }


def find_sharded_inputs(
    gm: fx.GraphModule, example_inputs: Iterable[object], shard: SequenceShard, seq_dim: int
) -> dict[fx.Node, SeqLayout]:
    """Graph inputs that carry this rank's sequence shard.

    A graph input is sharded when it is not a parameter or buffer and its ``seq_dim`` (else its only
    dim) has this rank's shard length. Inputs of a sub-graph (after a graph break or a DDP split) are
    found the same way, so each sub-graph can be rewritten on its own.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sharded = {}
    for node, example in zip(placeholders, example_inputs):
        value = example if isinstance(example, torch.Tensor) else example_value(node)
        if value is None or is_parameter_input(node, example) or value.dim() == 0:
            continue
        dim = _sequence_dim(tuple(value.shape), shard.local_len, preferred=seq_dim)
        if dim is not None:
            sharded[node] = SeqLayout(dim, shard.global_len)
    return sharded


def _sequence_dim(shape: tuple[int, ...], length: int, preferred: int) -> int | None:
    if preferred < len(shape) and shape[preferred] == length:
        return preferred
    candidates = [d for d, size in enumerate(shape) if size == length]
    return candidates[0] if len(candidates) == 1 else None


def propagate_sequence_layout(
    gm: fx.GraphModule, sharded_inputs: dict[fx.Node, SeqLayout]
) -> tuple[dict[fx.Node, SeqLayout], set[fx.Node]]:
    """Follow the sequence dim from the sharded inputs through the graph.

    Returns ``(layouts, derived)``: ``layouts`` maps each value that still has a sequence dim to it
    (found by shape: the dim of the output with the input's local length, preferring the same
    index); ``derived`` holds every value computed from sharded data, sequence dim or not (a loss
    over flattened tokens is derived but has no sequence dim).
    """
    layouts = dict(sharded_inputs)
    derived = set(sharded_inputs)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        inputs = [n for n in node.all_input_nodes if n in derived]
        if not inputs:
            continue
        derived.add(node)
        source = next((n for n in inputs if n in layouts), None)
        value, source_value = first_tensor_value(node), first_tensor_value(source)
        if source is None or value is None or source_value is None:
            continue
        layout = layouts[source]
        local_len = source_value.shape[layout.dim]
        global_len = layout.global_len
        if is_sequence_slice(node, layouts) or is_sequence_pad(node, layouts):
            # The output length differs from the input's: derive both from the op.
            local_len, global_len = _resized_lengths(node, layout, source_value)
        dim = _sequence_dim(tuple(value.shape), local_len, preferred=layout.dim)
        if dim is not None:
            layouts[node] = SeqLayout(dim, global_len)
    return layouts, derived


def is_sequence_slice(node: fx.Node, layouts: dict[fx.Node, SeqLayout]) -> bool:
    """``x[..., a:b, ...]`` on the sequence dim of a sharded value."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args
    if source not in layouts or example_value(source) is None:
        return False
    position = index_position(index, example_value(source).dim(), layouts[source].dim)
    if position is None:
        return False
    item = index[position] if isinstance(index, tuple) else index
    return isinstance(item, slice) and not _is_full_slice(item)


def _is_full_slice(item: slice) -> bool:
    return item.start in (None, 0) and item.stop is None and item.step in (None, 1)


def is_sequence_pad(node: fx.Node, layouts: dict[fx.Node, SeqLayout]) -> bool:
    """``F.pad`` whose padding touches the sequence dim of a sharded value."""
    if node.op != "call_function" or node.target not in PAD_TARGETS:
        return False
    source = node.args[0]
    if source not in layouts:
        return False
    ndim = example_value(source).dim()
    pads = node.args[1] if len(node.args) > 1 else node.kwargs["pad"]
    padded_dim = ndim - 1 - layouts[source].dim
    return padded_dim < len(pads) // 2 and tuple(pads[2 * padded_dim : 2 * padded_dim + 2]) != (0, 0)


def index_position(index: object, ndim: int, dim: int) -> int | None:
    """Position in an index tuple of the element that indexes tensor dim ``dim`` (None: not indexed)."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = [i for i, item in enumerate(items) if item is not None and item is not Ellipsis]
    if Ellipsis in items:
        ellipsis = items.index(Ellipsis)
        before = [i for i in consumed if i < ellipsis]
        after = [i for i in consumed if i > ellipsis]
        dims = {i: d for d, i in enumerate(before)} | {i: ndim - len(after) + k for k, i in enumerate(after)}
    else:
        dims = {i: d for d, i in enumerate(consumed)}
    for position, indexed in dims.items():
        if indexed == dim:
            return position
    return None


def _resized_lengths(node: fx.Node, layout: SeqLayout, source_value: torch.Tensor) -> tuple[int, int]:
    local, total = source_value.shape[layout.dim], layout.global_len
    if node.target in PAD_TARGETS:
        pads = node.args[1] if len(node.args) > 1 else node.kwargs["pad"]
        padded_dim = source_value.dim() - 1 - layout.dim
        left, right = pads[2 * padded_dim : 2 * padded_dim + 2]
        return local + left + right, total + left + right
    index = node.args[1]
    item = index[index_position(index, source_value.dim(), layout.dim)] if isinstance(index, tuple) else index
    return len(range(local)[item]), len(range(total)[item])
