"""flash-attn calls in a Dynamo graph, rewritten for sequence parallelism like SDPA.

flash-attn 2.x registers its kernels as ``torch.library`` ops (``flash_attn::_flash_attn_forward``,
``flash_attn::_flash_attn_varlen_forward`` and their backwards) and calls them from an
``autograd.Function``. Dynamo traces that Function into one higher-order op,
``autograd_function_apply(fwd_body, bwd_body, *tensors)``, whose ``fwd_body`` calls the forward op;
under ``no_grad`` (validation, test) the forward op sits in the graph itself. Either way the q/k/v it
receives are values of the graph, which we wrap in all-to-alls, and its first output is the attention
output, which we send back.

Layouts: ``flash_attn_func`` takes q/k/v as [B, S, H, D]; ``flash_attn_varlen_func`` takes [T, H, D],
the T tokens of one packed row, with ``cu_seqlens`` marking where each document starts.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
from torch import fx

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import example_value
from lightning_autosp.compiler.prove.plan import FlashMatch, SequenceParallelRefusal

log = logging.getLogger(__name__)

_FORWARD_OPS = {"flash_attn::_flash_attn_forward": "BSHD", "flash_attn::_flash_attn_varlen_forward": "SHD"}
_VARLEN_BACKWARD = "flash_attn::_flash_attn_varlen_backward"
# flash-attn 2's Function pads q/k/v to a head dim that is a multiple of 8 before calling the op.
_PASS_THROUGH = {"pad", "contiguous"}
# Attention kernels the pass does not rewrite: left alone they would see only this rank's tokens.
_UNSUPPORTED_NAMES = ("flash_attn", "flash_attention", "flex_attention")


def _qualified_name(target: object) -> str:
    packet = getattr(target, "_overloadpacket", target)
    return getattr(packet, "_qualified_op_name", "") or getattr(target, "__name__", "") or str(target)


def _looks_like_flash(node: fx.Node) -> bool:
    return node.op == "call_function" and any(s in _qualified_name(node.target) for s in _UNSUPPORTED_NAMES)


def bind_op(node: fx.Node) -> dict[str, object]:
    """A torch.library op call's arguments by schema name, defaults filled in."""
    overload = node.target if hasattr(node.target, "_schema") else node.target.default
    bound = {}
    for position, argument in enumerate(overload._schema.arguments):
        if position < len(node.args):
            bound[argument.name] = node.args[position]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


Refuse = Callable[[fx.Node, str, str], object]


def _raise(node: fx.Node, reason: str, fix: str) -> None:
    raise SequenceParallelRefusal(f"{node.name}: {reason}. {fix}")


def find_flash_attention(gm: fx.GraphModule, refuse: Refuse = _raise) -> list[FlashMatch]:
    """Every flash-attn 2.x call in the graph; a call in a form the pass does not know (flash-attn 3, a
    wrapper Dynamo did not trace into, more than one attention in one autograd.Function) goes to
    ``refuse(node, reason, fix)`` (the analysis' refusals; raised by default)."""
    matches = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.autograd_function_apply:
            body = getattr(gm, node.args[0].target)
            unknown = [
                n
                for n in body.graph.nodes
                if _looks_like_flash(n) and _qualified_name(n.target) not in _FORWARD_OPS
            ]
            if unknown:
                refuse(node, *_unknown_kernel(unknown[0]))
                continue
            found = [n for n in body.graph.nodes if _qualified_name(n.target) in _FORWARD_OPS]
            if len(found) > 1:
                refuse(
                    node,
                    f"one autograd.Function calls flash-attn {len(found)} times; the SP pass rewrites one "
                    "attention per Function",
                    "Call flash_attn_func / flash_attn_varlen_func once per Function",
                )
            elif found:
                matches.append(_match_in_function(node, body, found[0], refuse))
        elif _qualified_name(node.target) in _FORWARD_OPS:
            matches.append(_match_op(node, refuse))
        elif _looks_like_flash(node):
            refuse(node, *_unknown_kernel(node))
    return [match for match in matches if match is not None]


def _unknown_kernel(node: fx.Node) -> tuple[str, str]:
    return (
        f"{_qualified_name(node.target)} is not an attention call the SP pass can rewrite",
        "Supported: flash-attn 2.x's flash_attn_func and flash_attn_varlen_func (traced by torch.compile "
        "into flash_attn::_flash_attn_forward / _flash_attn_varlen_forward), "
        "torch.nn.functional.scaled_dot_product_attention, and attention written out",
    )


def _match_op(op: fx.Node, refuse: Refuse) -> FlashMatch | None:
    """The forward op in the graph itself (no autograd): its output 0 is the attention output."""
    outputs = {user.args[1]: user for user in op.users if user.target is operator.getitem}
    if any(index != 0 and user.users for index, user in outputs.items()) or 0 not in outputs:
        return refuse(
            op,
            "the attention probabilities or log-sum-exp of flash-attn are used; under SP they would be per "
            "head group",
            "Use only the attention output (return_attn_probs=False)",
        )
    arguments = bind_op(op)
    operands = {name: value for name, value in arguments.items() if isinstance(value, fx.Node)}
    return FlashMatch(op, op, arguments, operands, outputs[0], _FORWARD_OPS[_qualified_name(op.target)])


def _match_in_function(node: fx.Node, body: fx.GraphModule, op: fx.Node, refuse: Refuse) -> FlashMatch | None:
    """The forward op inside ``autograd_function_apply``'s fwd_body: map its tensors to the outer graph."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    outer = node.args[2:]
    if len(placeholders) != len(outer):
        return refuse(
            node,
            f"the autograd.Function around flash-attn takes {len(placeholders)} tensors but is called with "
            f"{len(outer)}, so the SP pass cannot tell which are q, k and v",
            "Call flash_attn_func / flash_attn_varlen_func as they are",
        )
    arguments = bind_op(op)
    operands = {}
    for name, value in arguments.items():
        if not isinstance(value, fx.Node):
            continue
        source = _through_pads(value)
        if source.op != "placeholder":
            return refuse(
                node,
                f"{name} of flash-attn is computed inside the autograd.Function ({source.name})",
                "Pass it as an input of the Function, as flash_attn_func does",
            )
        operands[name] = outer[placeholders.index(source)]
    (body_output,) = [n for n in body.graph.nodes if n.op == "output"]
    results = body_output.args[0][0]
    outputs = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    if len(results) != 1 or len(outputs) != 1:
        return refuse(
            node,
            f"the flash-attn Function returns {len(results)} values, read by {len(outputs)} ops "
            "(return_attn_probs=True?); under SP only the attention output goes back to sequence shards",
            "Use return_attn_probs=False and read the output once",
        )
    return FlashMatch(node, op, arguments, operands, outputs[0], _FORWARD_OPS[_qualified_name(op.target)])


def _through_pads(node: fx.Node) -> fx.Node:
    def name(n: fx.Node) -> str:
        return n.target if n.op == "call_method" else _qualified_name(n.target).split(".")[-1]

    while node.op in ("call_function", "call_method") and name(node) in _PASS_THROUGH:
        node = node.args[0]
    return node


def flash_refusal(match: FlashMatch, ctx: SPContext) -> tuple[str, str] | None:
    """(why, the fix) when a flash-attn call cannot be made exact under SP, for the analysis to refuse."""
    args = match.arguments
    if getattr(ctx.shard, "ring_degree", 1) > 1:
        return (
            "flash-attn under ring attention (sp_size larger than the heads) is not supported yet",
            "Use an sp_size that divides the heads, or F.scaled_dot_product_attention",
        )
    if args.get("alibi_slopes") is not None:
        return (
            "flash-attn with alibi_slopes is not supported under SP yet (the per-head slopes would have to "
            "follow the heads each rank holds)",
            "Use rotary or learned positions, or ALiBi as SDPA's attn_mask",
        )
    if args.get("return_softmax"):
        return "flash-attn returns its attention probabilities", "Use return_attn_probs=False under SP"
    paged = [name for name in ("block_table", "leftpad_k", "seqused_k") if args.get(name) is not None]
    if paged:
        return f"flash-attn's {', '.join(paged)} are KV-cache inference options", "Leave them out in training"
    query, key = (example_value(match.operands[name]) for name in ("q", "k"))
    local = ctx.shard.local_len
    if query.shape[match.seq_dim] != local or key.shape[match.seq_dim] != local:
        hint = (
            "Use one packed row per batch (batch size 1) and mark its documents with cu_seqlens: "
            "flash_attn_varlen_func over a batch flattened to B*S_r tokens is not supported"
            if match.layout == "SHD"
            else "Attend over the sequence the batch carries"
        )
        lengths = f"{query.shape[match.seq_dim]} query and {key.shape[match.seq_dim]} key positions"
        return (
            f"has {lengths} but this rank holds {local} tokens: only self-attention over the sharded "
            "sequence is supported",
            hint,
        )
    return None


def globalize_max_seqlen(gm: fx.GraphModule, match: FlashMatch, ctx: SPContext) -> None:
    """``max_seqlen_q/k`` bound the documents' lengths; after the all-to-all a document can be up to S
    long, and S is always a valid bound for flash-attn's varlen kernels (a larger one costs nothing)."""
    ops, bodies = [match.op], []
    if match.node is not match.op:  # autograd_function_apply: the backward body passes them again
        bodies = [getattr(gm, match.node.args[0].target), getattr(gm, match.node.args[1].target)]
        ops += [n for n in bodies[1].graph.nodes if _qualified_name(n.target) == _VARLEN_BACKWARD]
    for op in ops:
        for name in ("max_seqlen_q", "max_seqlen_k"):
            if name in bind_op(op):
                _set_op_argument(op, name, ctx.shard.global_len)
    for body in bodies:
        body.recompile()


def _set_op_argument(op: fx.Node, name: str, value: object) -> None:
    overload = op.target if hasattr(op.target, "_schema") else op.target.default
    position = [argument.name for argument in overload._schema.arguments].index(name)
    if position < len(op.args):
        op.args = (*op.args[:position], value, *op.args[position + 1 :])
    else:
        op.kwargs = {**op.kwargs, name: value}


def set_output_value(match: FlashMatch, query: torch.Tensor | None) -> None:
    """The attention output now has the all-to-all'd query's heads and sequence: [B, S, H/P, D]."""
    old = example_value(match.output)
    if old is None or query is None:
        return
    shape = list(old.shape)
    shape[match.head_dim], shape[match.seq_dim] = query.shape[match.head_dim], query.shape[match.seq_dim]
    match.output.meta["example_value"] = query.new_empty(shape, dtype=old.dtype)
