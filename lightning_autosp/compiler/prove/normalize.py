"""Before the analysis: the Dynamo graph in the ops the rules know, with nothing hidden in a region.

Writes into tensors nothing reads are dropped first (a cache's state updated in training, which only the
next call would read). Then two things a model does that hide what its ops do to the sequence:

- its own activation checkpointing (``torch.utils.checkpoint``, HF's ``gradient_checkpointing_enable()``):
  Dynamo traces each checkpointed call as ``tag_activation_checkpoint(body, *args)``, a region whose ops
  the rules cannot see. The body is inlined; what to recompute in backward is then SAC's choice
  (``sac.py``), which covers what the model's checkpointing did and never re-runs a collective;
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``), which
  Dynamo keeps as one call: it becomes the projections, ``scaled_dot_product_attention`` and the output
  projection it computes (its own SDPA path), which the attention rewrite then handles like any SDPA.
  Unused attention weights (``need_weights``' default) are not computed; used ones keep the call, and the
  analysis refuses it with the fix.

And adaptive pools to a single output (``F.adaptive_avg_pool1d(x, 1)``, ``nn.AdaptiveMaxPool1d(1)``, the
pooled heads of classifiers) become the mean or maximum over the pooled dims they compute, which the
reduction rule handles over a sharded sequence; other output sizes keep the call (refused over the
sequence: their windows follow the whole length).

And ``masked_scatter``, how vision-language models put image, video and audio features into the sequence
(Note [Features at placeholders]): it becomes the gather of feature rows it computes, each placeholder's
row numbered by the placeholders before it, which the rules handle over a sharded sequence.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.fx_utils import bind, call, eliminate_dead_code, example_value

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_REGIONS = ("tag_activation_checkpoint", "wrap")
# pool -> (its reduction, how many trailing dims it pools)
_ADAPTIVE_POOLS = {
    torch.adaptive_avg_pool1d: (torch.mean, 1),
    F.adaptive_avg_pool1d: (torch.mean, 1),
    F.adaptive_avg_pool2d: (torch.mean, 2),
    F.adaptive_avg_pool3d: (torch.mean, 3),
    F.adaptive_max_pool1d: (torch.amax, 1),
    F.adaptive_max_pool2d: (torch.amax, 2),
    F.adaptive_max_pool3d: (torch.amax, 3),
}


@dataclass
class Normalized:
    """What the normalization changed, for ``explain()``."""

    checkpoints: list[str] = field(default_factory=list)
    attention_modules: list[str] = field(default_factory=list)
    unread_buffers: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    scatters: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.checkpoints:
            out.append(
                "the model's own activation checkpointing was replaced by SAC (regions inlined: "
                f"{', '.join(self.checkpoints)})"
            )
        if self.attention_modules:
            out.append(f"nn.MultiheadAttention calls as SDPA: {', '.join(self.attention_modules)}")
        if self.unread_buffers:
            out.append(f"cache buffers written and never read, left out: {', '.join(self.unread_buffers)}")
        if self.pools:
            out.append(f"adaptive pools to one output as reductions: {', '.join(self.pools)}")
        if self.scatters:
            scatters = ", ".join(self.scatters)
            out.append(f"masked_scatter as a gather of feature rows at placeholder numbers: {scatters}")
        return out


def normalize_pass(gm: fx.GraphModule) -> Normalized:
    """Inline checkpointed regions and spell out multi-head attention modules (module docstring)."""
    done = Normalized()
    # A cache's state written in training and never read (HF's conv and SSM caches keep the last tokens
    # for the next call): nothing of the step depends on it, and the writes would need the last rank's.
    done.unread_buffers = eliminate_dead_code(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _REGIONS:
            done.checkpoints.append(_inline_region(gm, node))
        elif (
            node.op == "call_function"
            and node.target is F.multi_head_attention_forward
            and _spell_out_attention(gm.graph, node)
        ):
            done.attention_modules.append(node.name)
        elif _is_adaptive_pool(node) and _pool_as_reduction(gm.graph, node):
            done.pools.append(node.name)
        elif _is_masked_scatter(node) and _scatter_as_gather(gm.graph, node):
            done.scatters.append(node.name)
    if any((done.checkpoints, done.attention_modules, done.unread_buffers, done.pools, done.scatters)):
        eliminate_dead_code(gm.graph)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return done


def _inline_region(gm: fx.GraphModule, node: fx.Node) -> str:
    """``tag_activation_checkpoint(body, *args)`` -> the body's nodes, in place."""
    body_attr, *operands = node.args
    body: fx.GraphModule = getattr(gm, body_attr.target)
    copies: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    copies.update(zip(placeholders, operands))
    outputs: object = None
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], lambda n: copies[n])
                continue
            if inner.op == "get_attr":  # a constant of the body: hoisted onto the outer module
                name = f"{body_attr.target}_{inner.target}"
                setattr(gm, name, getattr(body, inner.target))
                copies[inner] = gm.graph.get_attr(name)
                continue
            copies[inner] = gm.graph.node_copy(inner, lambda n: copies[n])
    results = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return body_attr.target


def _spell_out_attention(graph: fx.Graph, node: fx.Node) -> bool:
    """``multi_head_attention_forward`` -> in-projection, SDPA, out-projection ([L, B, E] in and out).
    False (the call kept) for what its SDPA path does not cover."""
    args = bind(node, _MHA_SIGNATURE)
    weights_used = any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)
    if (
        weights_used
        or args["bias_k"] is not None
        or args["add_zero_attn"]
        or args["use_separate_proj_weight"]
        or args["static_k"] is not None
        or args["static_v"] is not None
        or not (args["query"] is args["key"] is args["value"])
    ):
        return False
    query, heads = args["query"], args["num_heads"]
    batch, embed = (int(size) for size in example_value(query).shape[1:])
    head_dim = embed // heads
    with graph.inserting_before(node):
        projected = call(graph, F.linear, (query, args["in_proj_weight"], args["in_proj_bias"]))  # [L, B, 3E]
        q, k, v = (
            _heads(
                graph,
                call(graph, operator.getitem, (projected, (Ellipsis, slice(i * embed, (i + 1) * embed)))),
                batch,
                heads,
                head_dim,
            )
            for i in range(3)
        )
        mask, is_causal = _sdpa_mask(graph, args, batch, heads, example_value(q).dtype)
        dropout = args["dropout_p"] if args["training"] else 0.0
        attended = call(
            graph,
            F.scaled_dot_product_attention,
            (q, k, v),
            {"attn_mask": mask, "dropout_p": dropout, "is_causal": is_causal},
        )  # [B, H, L, D]
        merged = call(
            graph, torch.reshape, (call(graph, torch.permute, (attended, (2, 0, 1, 3))), (-1, embed))
        )
        out = call(graph, F.linear, (merged, args["out_proj_weight"], args["out_proj_bias"]))
        out = call(graph, torch.reshape, (out, (-1, batch, embed)))  # [L, B, E]
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(out)
    return True


def _heads(graph: fx.Graph, x: fx.Node, batch: int, heads: int, head_dim: int) -> fx.Node:
    """[L, B, E] -> [B, H, L, D]."""
    split = call(graph, torch.reshape, (x, (-1, batch, heads, head_dim)))
    return call(graph, torch.permute, (split, (1, 2, 0, 3)))


def _sdpa_mask(
    graph: fx.Graph, args: dict, batch: int, heads: int, dtype: torch.dtype
) -> tuple[fx.Node | None, bool]:
    """The mask SDPA takes for the module's ``attn_mask`` / ``key_padding_mask`` / ``is_causal``, as torch's
    own SDPA path builds it (a causal hint without padding drops the mask; True in a bool mask blocks)."""
    mask, padding = args["attn_mask"], args["key_padding_mask"]
    if args["is_causal"] and padding is None:
        return None, True
    mask = _additive(graph, mask, dtype)
    if isinstance(mask, fx.Node) and example_value(mask).dim() == 3:  # [B * H, L, S]
        mask = call(graph, torch.reshape, (mask, (batch, heads, *example_value(mask).shape[1:])))
    if padding is not None:  # [B, S] -> [B, 1, 1, S]
        blocked = call(graph, torch.reshape, (_additive(graph, padding, dtype), (batch, 1, 1, -1)))
        mask = blocked if mask is None else call(graph, operator.add, (mask, blocked))
    return mask, False


def _additive(graph: fx.Graph, mask: object, dtype: torch.dtype) -> object:
    if not isinstance(mask, fx.Node) or example_value(mask).is_floating_point():
        return mask
    zeros = call(graph, torch.zeros_like, (mask,), {"dtype": dtype})
    return call(graph, torch.Tensor.masked_fill, (zeros, mask, float("-inf")))


def _is_adaptive_pool(node: fx.Node) -> bool:
    try:
        return node.op == "call_function" and node.target in _ADAPTIVE_POOLS
    except TypeError:  # an unhashable target
        return False


def _pool_as_reduction(graph: fx.Graph, node: fx.Node) -> bool:
    """An adaptive pool whose every pooled output size is 1 (or None: that dim kept) -> its mean or amax
    over those dims, ``keepdim=True``. False (the call kept) for other sizes and for max pools' indices."""
    reduction, pooled = _ADAPTIVE_POOLS[node.target]
    source = node.args[0]
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    sizes = [sizes] * pooled if not isinstance(sizes, (tuple, list)) else list(sizes)
    returns_indices = node.args[2] if len(node.args) > 2 else node.kwargs.get("return_indices", False)
    if returns_indices or len(sizes) != pooled or any(size not in (1, None) for size in sizes):
        return False
    rank = example_value(source).dim()
    dims = tuple(rank - pooled + i for i, size in enumerate(sizes) if size == 1)
    if not dims:
        return False
    with graph.inserting_before(node):
        reduced = call(graph, reduction, (source, dims), {"keepdim": True})
    node.replace_all_uses_with(reduced)
    graph.erase_node(node)
    return True


# Note [Features at placeholders]
#     A vision-language model inserts its image features into the token embeddings with
#     ``inputs_embeds.masked_scatter(mask, features)``: the k-th True element of the mask, in the order of
#     the flattened tensor, takes the k-th element of ``features``. On a rank holding a slice of the
#     sequence the count k must include the placeholders of the slices before its own, and of the samples
#     before each sample. The op is rewritten into what it computes, in ops whose rules know the sequence:
#     - the mask's rows (the dims it varies over; trailing dims it is broadcast over, the hidden dim, stay
#       whole), as counts;
#     - each row's number: per dim, an exclusive running sum of the rows counted over the dims after it
#       (over the sequence a running sum of token data, computed for the whole sequence; over the batch
#       the sum of every sample's placeholders, a partial sum made whole);
#     - the feature rows at those numbers (a replicated table indexed per token, like an embedding) and
#       ``where(mask, rows, inputs)``.
#     Forward and backward are then the single-device op's: a rank's gradient of ``features`` is that of
#     the rows its placeholders took, summed over the ranks like any replicated value's. The index is
#     [B, S] integers, not an element per hidden unit.


_SCATTER_ARGS = ((0, "input"), (1, "mask"), (2, "source"))  # ``self`` of the method is its input


def _is_masked_scatter(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "masked_scatter"
    return node.op == "call_function" and node.target in (torch.masked_scatter, torch.Tensor.masked_scatter)


def _scatter_as_gather(graph: fx.Graph, node: fx.Node) -> bool:
    """``x.masked_scatter(mask, source)`` -> ``where(mask, rows[number], x)`` (Note [Features at
    placeholders]). False (the call kept) where the mask's rows are not over whole, fixed-size trailing
    dims or ``source`` has no whole row."""
    x, mask, source = (node.args[i] if len(node.args) > i else node.kwargs.get(k) for i, k in _SCATTER_ARGS)
    values = [example_value(v) for v in (x, mask, source)]
    if any(v is None for v in values) or values[1].dtype != torch.bool or values[1].dim() > values[0].dim():
        return False
    x_value, mask_value, source_value = values
    rank = x_value.dim()
    mask_shape = [1] * (rank - mask_value.dim()) + list(mask_value.shape)
    varied = [d for d in range(rank) if not (isinstance(mask_shape[d], int) and mask_shape[d] == 1)]
    last = varied[-1] if varied else -1
    trailing = list(x_value.shape[last + 1 :])
    if not all(isinstance(size, int) for size in trailing) or not isinstance(source_value.numel(), int):
        return False
    width = math.prod(trailing)
    rows = source_value.numel() // width
    if rows == 0 or last < 0:
        return False
    lead = list(x_value.shape[: last + 1])
    with graph.inserting_before(node):
        flags = call(graph, torch.reshape, (mask, mask_shape[: last + 1]))
        counts = call(graph, torch.Tensor.expand, (call(graph, torch.Tensor.long, (flags,)), lead))
        number = None
        for dim in range(last + 1):
            inner = tuple(range(dim + 1, last + 1))
            per_dim = call(graph, torch.sum, (counts, inner), {"keepdim": True}) if inner else counts
            before = call(graph, operator.sub, (call(graph, torch.cumsum, (per_dim, dim)), per_dim))
            number = before if number is None else call(graph, operator.add, (number, before))
        number = call(graph, torch.clamp, (number, 0, rows - 1))
        table = call(graph, torch.reshape, (source, (-1,)))
        if rows * width != source_value.numel():
            table = call(graph, operator.getitem, (table, slice(None, rows * width)))
        table = call(graph, torch.reshape, (table, (rows, width)))
        picked = call(graph, operator.getitem, (table, number))  # [*lead, width]
        picked = call(graph, torch.Tensor.reshape_as, (picked, x))
        result = call(graph, torch.where, (mask, picked, x))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True
