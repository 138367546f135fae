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
from dataclasses import dataclass

import torch
from torch import fx

from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import example_value

log = logging.getLogger(__name__)

_FORWARD_OPS = {"flash_attn::_flash_attn_forward": "BSHD", "flash_attn::_flash_attn_varlen_forward": "SHD"}
_VARLEN_BACKWARD = "flash_attn::_flash_attn_varlen_backward"
# flash-attn 2's Function pads q/k/v to a head dim that is a multiple of 8 before calling the op.
_PASS_THROUGH = {"pad", "contiguous"}
# Attention kernels the pass does not rewrite: left alone they would see only this rank's tokens.
_UNSUPPORTED_NAMES = ("flash_attn", "flash_attention", "flex_attention")


@dataclass
class FlashMatch:
    """One flash-attn call: ``operands`` are the graph values the op reads, by its argument names."""

    node: fx.Node  # autograd_function_apply, or the forward op itself under no_grad
    op: fx.Node  # the forward op (inside fwd_body when ``node`` is autograd_function_apply)
    arguments: dict[str, object]  # the op's arguments by name, defaults filled in
    operands: dict[str, fx.Node]  # tensor arguments, as values of the outer graph
    output: fx.Node  # the outer value holding the attention output
    layout: str  # "BSHD" (flash_attn_func) or "SHD" (flash_attn_varlen_func)

    @property
    def head_dim(self) -> int:
        return self.layout.index("H")

    @property
    def seq_dim(self) -> int:
        return self.layout.index("S")

    @property
    def name(self) -> str:
        return self.node.name


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


def find_flash_attention(gm: fx.GraphModule) -> list[FlashMatch]:
    """Every flash-attn 2.x call in the graph.

    Raises:
        NotImplementedError: a flash-attn call in a form the pass does not know (flash-attn 3, a
            wrapper Dynamo did not trace into, more than one attention in one autograd.Function).
    """
    matches = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.autograd_function_apply:
            body = getattr(gm, node.args[0].target)
            found = [n for n in body.graph.nodes if _qualified_name(n.target) in _FORWARD_OPS]
            _refuse_unknown_flash(body, node.name)
            if len(found) > 1:
                raise NotImplementedError(
                    f"{node.name}: one autograd.Function calls flash-attn {len(found)} times; the SP pass "
                    "rewrites one attention per Function (flash_attn_func / flash_attn_varlen_func)."
                )
            if found:
                matches.append(_match_in_function(gm, node, body, found[0]))
        elif _qualified_name(node.target) in _FORWARD_OPS:
            matches.append(_match_op(node))
        elif _looks_like_flash(node):
            _refuse(node)
    return matches


def _refuse_unknown_flash(body: fx.GraphModule, where: str) -> None:
    for node in body.graph.nodes:
        if _looks_like_flash(node) and _qualified_name(node.target) not in _FORWARD_OPS:
            _refuse(node, where)


def _refuse(node: fx.Node, where: str | None = None) -> None:
    raise NotImplementedError(
        f"{where or node.name}: {_qualified_name(node.target)} is not an attention call the SP pass can "
        "rewrite. Supported: flash-attn 2.x's flash_attn_func and flash_attn_varlen_func (traced by "
        "torch.compile into flash_attn::_flash_attn_forward / _flash_attn_varlen_forward), and "
        "torch.nn.functional.scaled_dot_product_attention (HF: attn_implementation='sdpa')."
    )


def _match_op(op: fx.Node) -> FlashMatch:
    """The forward op in the graph itself (no autograd): its output 0 is the attention output."""
    outputs = {user.args[1]: user for user in op.users if user.target is operator.getitem}
    if any(index != 0 and user.users for index, user in outputs.items()) or 0 not in outputs:
        raise NotImplementedError(
            f"{op.name}: the attention probabilities or log-sum-exp of flash-attn are used; under SP "
            "they would be per head group. Use only the attention output (return_attn_probs=False)."
        )
    arguments = bind_op(op)
    operands = {name: value for name, value in arguments.items() if isinstance(value, fx.Node)}
    return FlashMatch(op, op, arguments, operands, outputs[0], _FORWARD_OPS[_qualified_name(op.target)])


def _match_in_function(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, op: fx.Node) -> FlashMatch:
    """The forward op inside ``autograd_function_apply``'s fwd_body: map its tensors to the outer graph."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    outer = node.args[2:]
    if len(placeholders) != len(outer):
        raise NotImplementedError(
            f"{node.name}: the autograd.Function around flash-attn takes {len(placeholders)} tensors but is "
            f"called with {len(outer)}; the SP pass cannot tell which are q, k and v."
        )
    arguments = bind_op(op)
    operands = {}
    for name, value in arguments.items():
        if not isinstance(value, fx.Node):
            continue
        source = _through_pads(value)
        if source.op != "placeholder":
            raise NotImplementedError(
                f"{node.name}: {name} of flash-attn is computed inside the autograd.Function "
                f"({source.name}); the SP pass needs it as an input of the Function, as in flash_attn_func."
            )
        operands[name] = outer[placeholders.index(source)]
    (body_output,) = [n for n in body.graph.nodes if n.op == "output"]
    results = body_output.args[0][0]
    if len(results) != 1:
        raise NotImplementedError(
            f"{node.name}: the flash-attn Function returns {len(results)} values (return_attn_probs=True?); "
            "under SP only the attention output can be sent back to sequence shards."
        )
    outputs = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    if len(outputs) != 1:
        raise NotImplementedError(f"{node.name}: the flash-attn output is not read as one value.")
    return FlashMatch(node, op, arguments, operands, outputs[0], _FORWARD_OPS[_qualified_name(op.target)])


def _through_pads(node: fx.Node) -> fx.Node:
    def name(n: fx.Node) -> str:
        return n.target if n.op == "call_method" else _qualified_name(n.target).split(".")[-1]

    while node.op in ("call_function", "call_method") and name(node) in _PASS_THROUGH:
        node = node.args[0]
    return node


def check_flash_attention(match: FlashMatch, ctx: SPContext) -> None:
    """Raise, naming the fix, when a flash-attn call cannot be made exact under SP."""
    args, world = match.arguments, ctx.shard.world
    if getattr(ctx.shard, "ring_degree", 1) > 1:
        raise NotImplementedError(
            f"{match.name}: flash-attn under ring attention (sp_size larger than the heads) is not supported "
            "yet. Use an sp_size that divides the heads, or F.scaled_dot_product_attention."
        )
    if args.get("alibi_slopes") is not None:
        raise NotImplementedError(
            f"{match.name}: flash-attn with alibi_slopes is not supported under SP yet (the per-head slopes "
            "would have to follow the heads each rank holds). Use rotary or learned positions."
        )
    if args.get("return_softmax"):
        raise NotImplementedError(f"{match.name}: use return_attn_probs=False under SP.")
    paged = [name for name in ("block_table", "leftpad_k", "seqused_k") if args.get(name) is not None]
    if paged:
        raise NotImplementedError(
            f"{match.name}: flash-attn's {', '.join(paged)} (KV-cache inference) are not supported under SP."
        )
    query, key = (example_value(match.operands[name]) for name in ("q", "k"))
    local = ctx.shard.local_len
    if query.shape[match.seq_dim] != local or key.shape[match.seq_dim] != local:
        hint = (
            " flash_attn_varlen_func over a batch flattened to B*S_r tokens is not supported: use one packed "
            "row per batch (batch size 1) and mark its documents with cu_seqlens."
            if match.layout == "SHD"
            else ""
        )
        lengths = f"{query.shape[match.seq_dim]} query and {key.shape[match.seq_dim]} key positions"
        raise NotImplementedError(
            f"Attention {match.name} has {lengths} but this rank holds {local} tokens: only self-attention "
            f"over the sharded sequence is supported.{hint}"
        )
    heads = query.shape[match.head_dim]
    if heads % world:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"sp_size={world} must divide the number of attention heads ({heads}) of {match.name}; "
            f"use one of {divisors}."
        )


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
