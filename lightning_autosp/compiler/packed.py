"""Attention masks computed from per-token data (packed documents), rebuilt for the whole sequence.

Note [Packed sequences]
    A packed row holds several documents; ``position_ids`` restart at each document (or document
    ids mark them), and attention must not cross documents. The data layer shards ``position_ids``
    like ``input_ids`` ([B, S] -> [B, S_r], Note [Sequence sharding] in ``data.py``), so whatever
    uses them per token (rotary or learned position embeddings) is right as it is. The attention
    mask is not per token: after the all-to-all, attention relates all S positions, so its mask
    needs the document structure of the whole row, which no rank has.

    The pass gathers each per-token input the mask is computed from over the sp group (integer or
    bool data only; one ``gather_sequence`` per input per graph, placed right after the graph
    inputs) and re-runs the mask's producers on the gathered values at the global length::

        position_ids [B, S_r] -> diff, cumsum, compare -> mask [B, 1, S_r, S_r]
      becomes
        position_ids [B, S_r] -> gather_sequence -> [B, S] -> diff, cumsum, compare -> mask [B, 1, S, S]

    HF transformers 5 builds exactly such a mask when ``position_ids`` are given to a model with
    ``attn_implementation="sdpa"`` (``masking_utils.find_packed_sequence_indices``: a document
    starts where the position does not grow by 1; under torch.compile the mask is always built),
    and so does a hand-written model that compares document ids. ``flash_attn_varlen_func`` takes
    ``cu_seqlens`` instead: those must come with the batch, for the whole row, and are used as they
    are (``compiler/flash.py``). A mask computed from activations (through parameters) or from
    floating-point inputs is refused: gathering those would gather the model.
"""

from __future__ import annotations

import torch
from torch import fx

from lightning_autosp.compiler.analysis import example_value, is_parameter_input, is_sdpa
from lightning_autosp.compiler.sp_pass import SPContext, _ancestors, _call, _rebuild_at_global_length

_GATHER = torch.ops.autosp.gather_sequence.default
_GLOBAL_COPY = "autosp_global_token_mask"


def token_mask_inputs(mask: fx.Node, derived: set[fx.Node]) -> tuple[list[fx.Node], list[str]]:
    """(the per-token graph inputs ``mask`` is computed from, reasons it cannot be rebuilt from them)."""
    tokens, reasons = [], []
    for node in sorted(_ancestors(mask), key=lambda n: n.name):
        value = example_value(node)
        if node.op == "placeholder" and node in derived:
            if value is None or value.is_floating_point():
                reasons.append(f"the floating-point input {node.name}")
            else:
                tokens.append(node)
        elif node.op == "placeholder" and is_parameter_input(node, value):
            reasons.append(f"the parameter {node.name}")
        elif node.op == "call_function" and (is_sdpa(node) or "autosp" in str(node.target)):
            reasons.append(f"the attention or collective {node.name}")
    return tokens, reasons


def is_token_mask(mask: fx.Node, derived: set[fx.Node]) -> bool:
    """Whether ``mask`` is computed from integer per-token inputs only (and can be rebuilt from them)."""
    tokens, reasons = token_mask_inputs(mask, derived)
    return bool(tokens) and not reasons


def globalize_token_mask(
    graph: fx.Graph, mask: fx.Node, ctx: SPContext, derived: set[fx.Node], *, user: str
) -> fx.Node:
    """The mask for the whole sequence, computed from the gathered per-token inputs (Note [Packed sequences]).

    Before (rank r): ``position_ids [B, S_r] -> ... -> mask [B, 1, S_r, S_r]``
    After:           ``position_ids [B, S_r] -> gather_sequence -> [B, S] -> ... -> mask [B, 1, S, S]``

    The copy is placed right after its inputs, so every attention and the graph output can use it;
    a second call for the same mask returns the same copy.

    Raises:
        NotImplementedError: the mask depends on parameters, floating-point inputs or attention.
    """
    cached = mask.meta.get(_GLOBAL_COPY)
    if cached is not None and cached in graph.nodes:
        return cached
    if not getattr(ctx.shard, "is_contiguous", True):  # the gather concatenates shards in rank order
        raise NotImplementedError(
            f"The attention mask of {user} is computed from per-token data (packed documents), which is not "
            "supported with ring_layout='zigzag' yet. Use AutoSPStrategy(ring_layout='contiguous')."
        )
    tokens, reasons = token_mask_inputs(mask, derived)
    if reasons or not tokens:
        raise NotImplementedError(
            f"The attention mask of {user} ({mask.name}) is computed from per-token data through "
            f"{', '.join(reasons) or 'values the SP pass cannot trace'}, so it cannot be rebuilt for the "
            "whole sequence. Build the mask from integer per-token inputs of the batch (position_ids that "
            "restart at each document, document ids), or use is_causal=True."
        )
    gathered = {token: _gathered(graph, token, ctx) for token in tokens}
    order = {node: index for index, node in enumerate(graph.nodes)}
    inputs = [*gathered.values(), *(n for n in _ancestors(mask) if n.op in ("placeholder", "get_attr"))]
    last_input = max(inputs, key=order.__getitem__)
    with graph.inserting_before(last_input.next):
        rebuilt = _rebuild_at_global_length(graph, mask, ctx, inputs=gathered)
    mask.meta[_GLOBAL_COPY] = rebuilt
    return rebuilt


def _gathered(graph: fx.Graph, token: fx.Node, ctx: SPContext) -> fx.Node:
    """``gather_sequence(token)`` right after the graph inputs; one per input and graph."""
    shape, local = tuple(example_value(token).shape), ctx.shard.local_len
    dim = ctx.seq_dim if ctx.seq_dim < len(shape) and shape[ctx.seq_dim] == local else shape.index(local)
    for user in token.users:
        if user.target is _GATHER and user.args[1] == dim:
            return user
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        return _call(graph, _GATHER, (token, dim, list(ctx.shard.seq_lens), ctx.group_name))
