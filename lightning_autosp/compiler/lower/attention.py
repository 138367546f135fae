"""Attention over the whole sequence for a slice of the heads: all-to-alls around SDPA and flash-attn.

Before::

    q, k, v [B, H, S_r, D] -> sdpa(is_causal | attn_mask [S_r, S_r]) -> [B, H, S_r, D]

After::

    q, k, v [B, H, S_r, D] -> seq_to_head_packed (one all-to-all) -> [B, H/P, S, D] each
        -> sdpa(is_causal | attn_mask [S, S]) -> [B, H/P, S, D] -> head_to_seq -> [B, H, S_r, D]

flash-attn's [B, S, H, D] (and varlen's [T, H, D], one packed row) likewise. K/V go with the heads the
model has (HF's ``repeat_kv`` in front of SDPA is undone; ``enable_gqa`` pairs the heads), repeated only
when there are fewer than can be split over P (lcm(H_kv, P) heads keeps every q head with its own KV
head). Under autocast q/k/v cross the all-to-all in attention's dtype.

With ring_degree R > 1, P is the Ulysses degree U = sp_size / R: the all-to-all runs over the U ranks of
this rank's ring rank, and ring attention over the R ring ranks takes SDPA's place::

    q, k, v [B, H, S_r, D] -> seq_to_head -> [B, H/U, L_i, D] -> ring_attention -> [B, H/U, L_i, D]
        -> head_to_seq -> [B, H, S_r, D]         (L_i: ring rank i's tokens, Note [Ring layouts])
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import call, example_value, redirect_uses, set_fake_value
from lightning_autosp.compiler.prove.flash import (
    FlashMatch,
    globalize_max_seqlen,
    set_output_value,
)
from lightning_autosp.compiler.prove.plan import AttentionCall
from lightning_autosp.compiler.runtime import ops
from lightning_autosp.compiler.runtime.ring import ring_args

_SEQ_TO_HEAD = ops.seq_to_head
_SEQ_TO_HEAD_PACKED = ops.seq_to_head_packed
_HEAD_TO_SEQ = ops.head_to_seq
_KEYWORDS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # SDPA's, after q, k and v


def set_mask(node: fx.Node, call: AttentionCall, mask: object, is_causal: bool) -> None:
    """Give an SDPA call its mask for the whole sequence (from ``masks.attention_mask``), in the one form
    lowering reads (``_arguments``)."""
    _write_arguments(
        node,
        {
            "query": call.query,
            "key": call.key,
            "value": call.value,
            "attn_mask": mask,
            "dropout_p": call.dropout_p,
            "is_causal": is_causal,
            "scale": call.scale,
            "enable_gqa": call.enable_gqa,
        },
    )


def _write_arguments(node: fx.Node, args: dict[str, object]) -> None:
    """An SDPA call's arguments in one form: q, k and v as arguments, the rest as keywords."""
    node.args = (args["query"], args["key"], args["value"])
    node.kwargs = {name: args[name] for name in _KEYWORDS}


def _arguments(node: fx.Node) -> dict[str, object]:
    """An SDPA call's arguments by name, in the form ``_write_arguments`` gave it."""
    query, key, value = node.args
    return {"query": query, "key": key, "value": value, **node.kwargs}


def sdpa_pass(
    graph: fx.Graph, node: fx.Node, ctx: SPContext, report, seq_lens: list[int] | None = None
) -> None:
    """Rewrite one SDPA call (its mask already set for the whole sequence by ``set_mask``). ``seq_lens``:
    every rank's positions of q, k and v where their sequence is derived from the batch's (tokens
    joined to it, a convolution's output), as ``SequenceShard.counts`` gives them."""
    comm_args = ctx.ulysses_comm_args if seq_lens is None else (seq_lens, ctx.shard.rank, ctx.group_name)
    world = ctx.shard.ulysses_degree
    args = _arguments(node)
    query, key, value = args["query"], args["key"], args["value"]
    kv_heads = example_value(key).shape[1]
    with graph.inserting_before(node):
        unrepeated = _before_kv_repeat(node, args)
        if unrepeated is not None:
            # Send the K/V heads the model has, not its copies; SDPA pairs the heads (enable_gqa).
            key, value = unrepeated
            kv_heads = example_value(key).shape[1]
            args["enable_gqa"] = True
            report.replicated_kv_heads.append(
                f"{node.name}: K/V sent with their {kv_heads} heads, paired by enable_gqa"
            )
        if kv_heads % world:
            repeats = world // math.gcd(kv_heads, world)
            key = call(graph, torch.repeat_interleave, (key, repeats), {"dim": 1})
            value = call(graph, torch.repeat_interleave, (value, repeats), {"dim": 1})
            report.replicated_kv_heads.append(f"{node.name}: {kv_heads} -> {kv_heads * repeats}")
        # An explicit mask sends CPU SDPA down its math path, which Inductor's attention-fusion patterns
        # rewrite; their check fails hard (torch 2.13) on q, k, v that arrive as the all-to-all's
        # permuted views (Note [Token-major all-to-all]). There: one copy each, next to S x S scores.
        copy = {"contiguous": True} if args["attn_mask"] is not None else {}
        tensors = _in_attention_dtype(graph, node, (query, key, value), report)
        q, k, v = seq_to_head_together(graph, tensors, (1, 2), comm_args, report, copy)
    _write_arguments(node, {**args, "query": q, "key": k, "value": v})
    set_fake_value(node)  # now [B, H/P, S, D]
    attention = node
    if ctx.shard.ring_degree > 1:
        attention = _lower_to_ring_attention(graph, node, ctx)
        report.ring_attention.append(node.name)
    with graph.inserting_after(attention):
        back = call(graph, _HEAD_TO_SEQ, (attention, 1, 2, *comm_args))
    redirect_uses(attention, back)
    report.attention.append(node.name)
    report.all_to_alls += 1  # the output's; q, k and v's counted above


def seq_to_head_together(
    graph: fx.Graph,
    tensors: tuple[fx.Node, ...],
    dims: tuple[int, int],
    comm_args: tuple,
    report,
    copy: dict | None = None,
) -> tuple[fx.Node, ...]:
    """q, k and v to the head layout in one all-to-all (Note [One all-to-all for q, k and v] in ops.py)
    where they can share its buffer (one dtype and device, every dim but the heads alike), else one each."""
    values = [example_value(t) for t in tensors]
    first = values[0]
    kept = [d for d in range(first.dim()) if d != dims[0] % first.dim()]
    alike = all(
        (v.dtype, v.device, v.dim()) == (first.dtype, first.device, first.dim())
        and all(statically_known_true(v.shape[d] == first.shape[d]) for d in kept)
        for v in values
    )
    if not alike:
        report.all_to_alls += len(tensors)
        return tuple(call(graph, _SEQ_TO_HEAD, (t, *dims, *comm_args), copy) for t in tensors)
    report.all_to_alls += 1
    packed = call(graph, _SEQ_TO_HEAD_PACKED, (list(tensors), *dims, *comm_args), copy)
    return tuple(call(graph, operator.getitem, (packed, index)) for index in range(len(tensors)))


def _in_attention_dtype(
    graph: fx.Graph, node: fx.Node, tensors: tuple[fx.Node, ...], report
) -> tuple[fx.Node, ...]:
    """Cast q, k, v to the dtype attention computes in before they cross the all-to-all.

    Under autocast, attention casts its inputs to the autocast dtype; HF's rotary embeddings leave q
    and k in float32 (cos and sin are float32), which would double their all-to-all bytes and their
    saved copies. An all-to-all only moves elements, so casting before it is what autocast would do
    after it. Attention's traced output dtype differs from an input's only when autocast casts.
    """
    compute_dtype = example_value(node).dtype
    cast = []
    for tensor in tensors:
        if example_value(tensor).dtype != compute_dtype:
            report.casts.append(f"{tensor.name} {example_value(tensor).dtype} -> {compute_dtype}")
            tensor = call(graph, torch.Tensor.to, (tensor, compute_dtype))
        cast.append(tensor)
    return tuple(cast)


def _repeat_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, n)`` if ``node`` is ``x[:, :, None].expand(.., n, ..).reshape(..)``: K/V heads repeated n times
    (HF's ``repeat_kv``), else None."""
    if node.op != "call_method" or node.target not in ("reshape", "view"):
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.op != "call_method" or expand.target != "expand":
        return None
    unsqueezed = expand.args[0]
    if not isinstance(unsqueezed, fx.Node) or unsqueezed.target is not operator.getitem:
        return None
    source = unsqueezed.args[0]
    values = [example_value(n) for n in (node, expand, unsqueezed, source)]
    if not all(isinstance(v, torch.Tensor) for v in values) or not isinstance(source, fx.Node):
        return None
    out, expanded, middle, original = values
    if original.dim() != 4 or middle.dim() != 5 or middle.shape[2] != 1:
        return None
    repeats = int(expanded.shape[2])
    expected = [int(s) for s in original.shape]
    expected[1] *= repeats
    unsqueezed_shape = [int(s) for s in (*original.shape[:2], 1, *original.shape[2:])]
    if [int(s) for s in out.shape] != expected or [int(s) for s in middle.shape] != unsqueezed_shape:
        return None
    return source, repeats


def _before_kv_repeat(node: fx.Node, args: dict) -> tuple[fx.Node, fx.Node] | None:
    """K and V before a ``repeat_kv`` in front of SDPA, when both repeat alike and nothing else uses them."""
    if args["enable_gqa"]:
        return None
    key, value = _repeat_source(args["key"]), _repeat_source(args["value"])
    if key is None or value is None or key[1] != value[1] or key[1] < 2:
        return None
    if len(args["key"].users) != 1 or len(args["value"].users) != 1:
        return None
    return key[0], value[0]


def _lower_to_ring_attention(graph: fx.Graph, sdpa: fx.Node, ctx: SPContext) -> fx.Node:
    """Replace the (all-to-all'd) SDPA call by ring attention over the ring group; returns its output.

    ``enable_gqa`` needs no flag: the ring op pairs q head h with K/V head h // (H / H_kv) as SDPA does.
    """
    # Attention dropout was refused by the analysis (rules/products.py); so are masks computed through
    # parameters, the only ones that could need a gradient.
    args = _arguments(sdpa)
    bounds, range_counts, ring_rank = ring_args(ctx.shard)
    operands = (args["query"], args["key"], args["value"], args["attn_mask"], bool(args["is_causal"]))
    with graph.inserting_before(sdpa):
        pair = call(
            graph,
            torch.ops.autosp.ring_attention.default,
            (*operands, args["scale"], bounds, range_counts, ring_rank, ctx.ring_group_name),
        )
        out = call(graph, operator.getitem, (pair, 0))
    sdpa.replace_all_uses_with(out)
    graph.erase_node(sdpa)
    return out


def flash_pass(gm: fx.GraphModule, match: FlashMatch, ctx: SPContext, report) -> None:
    """Give one flash-attn call the whole sequence for H/P of the heads (``flash.py`` found it)."""
    graph, world = gm.graph, ctx.shard.world
    dims = (match.head_dim, match.seq_dim)
    query, key, value = (match.operands[name] for name in ("q", "k", "v"))
    kv_heads = example_value(key).shape[match.head_dim]
    with graph.inserting_before(match.node):
        if kv_heads % world:
            repeats = world // math.gcd(kv_heads, world)
            repeated = [
                call(graph, torch.repeat_interleave, (t, repeats), {"dim": match.head_dim})
                for t in (key, value)
            ]
            report.replicated_kv_heads.append(f"{match.name}: {kv_heads} -> {kv_heads * repeats}")
        else:
            repeated = [key, value]
        received = seq_to_head_together(graph, (query, *repeated), dims, ctx.comm_args, report)
        exchanged = dict(zip((query, key, value), received))
    match.node.args = fx.node.map_arg(match.node.args, lambda n: exchanged.get(n, n))
    match.node.kwargs = fx.node.map_arg(match.node.kwargs, lambda n: exchanged.get(n, n))
    set_output_value(match, example_value(exchanged[query]))
    if match.layout == "SHD":
        globalize_max_seqlen(gm, match, ctx)
    with graph.inserting_after(match.output):
        back = call(graph, _HEAD_TO_SEQ, (match.output, *dims, *ctx.comm_args))
    redirect_uses(match.output, back)
    report.attention.append(match.name)
    report.all_to_alls += 1  # the output's; q, k and v's counted above


__all__ = ["F", "flash_pass", "sdpa_pass", "set_mask"]
