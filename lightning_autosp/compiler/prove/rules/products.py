"""Rules for ops that multiply across dims or relate tokens to tokens: linear layers, matmuls, einsum,
linear solves, convolutions, embeddings, attention.

A product over another dim propagates. A product over the sequence of two sharded values is a partial sum
(``k^T v``); one that relates tokens to tokens (attention written out) runs on the whole sequence for a
block of a dim it treats independently, as does a grouped convolution (Note [Redistribution]); SDPA and
flash-attn are that move with their own lowering (``attention.py``).
"""

from __future__ import annotations

import inspect

import sympy
from torch import fx

from lightning_autosp.compiler.fx_utils import bind, meta_value, op_name
from lightning_autosp.compiler.prove.flash import flash_refusal
from lightning_autosp.compiler.prove.layout import CAUSAL, PARTIAL, REFUSED, REPLICATE, Layout, shard
from lightning_autosp.compiler.prove.plan import (
    AttentionCall,
    ConvolutionWindow,
    Decided,
    SplitConvolution,
    decide,
)
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import (
    ATTENTION_FIX,
    SDPA_SIGNATURE,
    arg,
    materialize_all,
    ndim,
    no_split_fix,
)
from lightning_autosp.compiler.prove.rules.elementwise import elementwise_function
from lightning_autosp.compiler.prove.rules.split import (
    Operand,
    align,
    broadcast,
    choose,
    handles_split,
    split_operands,
)


@dispatch.handles_local_order
def linear(a, node: fx.Node) -> Layout:
    layouts = materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    if any(layout.kind != "replicate" for layout in layouts[1:]):
        return a.refuse(node, "multiplies by a weight that holds sequence data", "Keep weights replicated")
    if ndim(source) - 1 in layout.dims:
        return a.refuse(node, "contracts over the sequence dim", ATTENTION_FIX)
    return layout


@dispatch.handles_local_order
@handles_split
def matmul(a, node: fx.Node) -> Layout:
    """matmul / @ / mm / bmm: contracts the last dim of the left with the second-last of the right."""
    materialize_all(a, node)
    return _product(a, node, node.args[0], node.args[1])


@dispatch.handles_local_order
@handles_split
def add_product(a, node: fx.Node) -> Layout:
    """addmm / baddbmm (GPT-2's Conv1D, Bloom's ALiBi scores): ``beta * input + alpha * (left @ right)``."""
    materialize_all(a, node)
    first, second = ("batch1", "batch2") if op_name(node) == "baddbmm" else ("mat1", "mat2")
    bias, left, right = arg(node, 0, "input"), arg(node, 1, first), arg(node, 2, second)
    return _product(a, node, left, right, bias=bias)


@handles_split
def solve(a, node: fx.Node) -> Layout:
    """linalg.solve_triangular / linalg.solve (``A^-1 B``, batched over the leading dims): laid out like the
    product ``A @ B`` (chunked gated-delta rules solve within chunks of the whole sequence)."""
    materialize_all(a, node)
    return _product(a, node, arg(node, 0, "A"), arg(node, 1, "B"))


def _matmul_operands(left: fx.Node, right: fx.Node, rank: int) -> list[Operand]:
    """Where each dim of a matmul's operands goes in its output (batch dims broadcast from the right)."""
    rank_l, rank_r = ndim(left), ndim(right)
    to_left = {d: d + rank - rank_l for d in range(rank_l - 2)}
    if rank_l >= 2:
        to_left[rank_l - 2] = rank - 2 if rank_r >= 2 else rank - 1
    to_right = {d: d + rank - rank_r for d in range(rank_r - 2)}
    if rank_r >= 2:
        to_right[rank_r - 1] = rank - 1
    return [Operand(left, to_left), Operand(right, to_right)]


def _product(a, node: fx.Node, left: fx.Node, right: fx.Node, bias: object = None) -> Layout:
    rank_l, rank_r, rank = ndim(left), ndim(right), ndim(node)
    if any(a.layout(t).is_local_order for t in (left, right, bias) if isinstance(t, fx.Node)):
        # rows of this rank's tokens times weights: per row (dim 0 of a left operand with more dims)
        if (
            a.layout(left).kind == "rows"
            and rank_l >= 2
            and all(a.layout(t) == REPLICATE for t in (right, bias) if isinstance(t, fx.Node))
        ):
            return a.layout(left)
        return a.refuse(node, "multiplies across rows of this rank's tokens", dispatch.FIX)
    operands = _matmul_operands(left, right, rank)
    if isinstance(bias, fx.Node):
        operands.append(broadcast(bias, rank))
    batch = list(range(rank - 2))
    regrouped = _product_of_split(a, operands, rank)
    if regrouped is not None:
        return regrouped
    if isinstance(bias, fx.Node) and a.layout(bias) != REPLICATE and not _pairwise(a, left, right):
        return a.refuse(node, "adds a product to a value that holds sequence data", "Add the bias separately")
    lay_l, lay_r = a.layout(left), a.layout(right)
    contracted_l = rank_l - 1 in lay_l.dims
    contracted_r = (rank_r >= 2 and rank_r - 2 in lay_r.dims) or (rank_r == 1 and 0 in lay_r.dims)
    if contracted_l or contracted_r:
        if _sum_over_tokens(a, node, left, right, contracted_l and contracted_r) and bias is None:
            return PARTIAL
        what = "multiplies matrices over the sequence dim (attention written by hand?)"
        return _split_or_refuse(a, node, operands, batch, rank, what, REPLICATE)
    dims = {d + rank - rank_l for d in lay_l.dims}
    if rank_r >= 2:
        dims |= {d + rank - rank_r for d in lay_r.dims if d != rank_r - 1} | (
            {rank - 1} if rank_r - 1 in lay_r.dims else set()
        )
    if _pairwise(a, left, right):
        what = "forms a [tokens x tokens] matrix of activations (attention written by hand?)"
        return _split_or_refuse(a, node, operands, batch, rank, what, shard(*dims))
    return shard(*dims)


def _pairwise(a, left: fx.Node, right: fx.Node) -> bool:
    rank_l, rank_r = ndim(left), ndim(right)
    lay_l, lay_r = a.layout(left), a.layout(right)
    return rank_l >= 2 and rank_l - 2 in lay_l.dims and rank_r >= 2 and rank_r - 1 in lay_r.dims


def _sum_over_tokens(a, node: fx.Node, left: fx.Node, right: fx.Node, both: bool) -> bool:
    """``k^T @ v`` over this rank's tokens, both sharded along the contracted dim only: a partial sum
    (the state of linear attention without a causal mask)."""
    lay_l, lay_r = a.layout(left), a.layout(right)
    return (
        both
        and lay_l.kind == lay_r.kind == "shard"
        and len(lay_l.dims) == len(lay_r.dims) == 1
        and not lay_l.flat
        and not lay_r.flat
        and node not in a.token_data
    )


def _product_of_split(a, operands: list[Operand], rank: int) -> Layout | None:
    """A product with a split operand stays split along a dim it does not contract; else the split
    operands go back to sequence shards."""
    split_side = split_operands(a, operands)
    if not split_side:
        return None
    out_dim = split_side[0].to_out.get(a.layout(split_side[0].node).split)
    regrouped = align(a, operands, out_dim, rank) if out_dim is not None else None
    if regrouped is None:
        for operand in split_side:
            a.sequence_home(operand.node)
    return regrouped


def _split_or_refuse(
    a, node: fx.Node, operands: list[Operand], batch: list[int], rank: int, what: str, out: Layout
) -> Layout:
    """An op that relates tokens to tokens: on the whole sequence for a block of a batch dim (heads),
    else refused (token data: recomputed)."""
    if node not in a.token_data:
        out_dim = choose(a, operands, batch)
        regrouped = align(a, operands, out_dim, rank) if out_dim is not None else None
        if regrouped is not None:
            return regrouped
    return a.mixes(node, what, out, no_split_fix(a, operands[0].node, ATTENTION_FIX))


@dispatch.handles_local_order
@handles_split
def einsum(a, node: fx.Node) -> Layout:
    """einsum: per token when every sharded operand carries the sequence letter into the output; a sum
    over tokens (``PARTIAL``) when the letter is summed; anything relating tokens to tokens runs on the
    whole sequence for a block of a letter every operand shares (Note [Redistribution])."""
    equation, operands = _einsum_parts(node)
    if equation is None or "." in equation:
        return a.refuse(
            node,
            "uses an einsum with '...' or in a form the pass does not parse",
            "Spell out every dim's letter (e.g. 'bhsd,bhtd->bhst')",
        )
    materialize_all(a, node)
    if any(a.layout(op).is_local_order for op in operands):
        return a.refuse(node, "relates rows of this rank's tokens in an einsum", dispatch.FIX)
    inputs, out = _einsum_letters(equation)
    rank = len(out)
    mapped = [
        Operand(op, {d: out.index(letter) if letter in out else None for d, letter in enumerate(letters)})
        for op, letters in zip(operands, inputs)
    ]
    regrouped = _product_of_split(a, mapped, rank)
    if regrouped is not None:
        return regrouped
    layouts = [a.layout(op) for op in operands]
    sequence = {letters[d] for letters, layout in zip(inputs, layouts) for d in layout.dims}
    if not sequence:
        return REPLICATE
    if len(sequence) == 1 and all(layout.kind in ("shard", "replicate") for layout in layouts):
        (letter,) = sequence
        sharded = [layout for layout in layouts if layout.kind == "shard"]
        replicated = [letters for letters, layout in zip(inputs, layouts) if layout.kind == "replicate"]
        if all(len(x.dims) == 1 for x in sharded) and not any(letter in x for x in replicated):
            if letter not in out:
                return PARTIAL  # a sum over this rank's tokens
            flat = (out.index(letter),) if any(x.flat for x in sharded) else ()
            return shard(out.index(letter), flat=flat)  # token by token
    candidates = [out.index(letter) for letter in out if letter not in sequence]
    return _split_or_refuse(
        a,
        node,
        mapped,
        candidates,
        rank,
        "relates tokens to tokens (einsum)",
        shard(*[out.index(letter) for letter in sequence if letter in out]),
    )


def _einsum_parts(node: fx.Node) -> tuple[str | None, list[fx.Node]]:
    args = list(node.args)
    if not args or not isinstance(args[0], str):
        return None, []
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return args[0].replace(" ", ""), [op for op in operands if isinstance(op, fx.Node)]


def _einsum_letters(equation: str) -> tuple[list[str], str]:
    left, _, out = equation.partition("->")
    inputs = left.split(",")
    if "->" not in equation:  # implicit output: the letters used once, in order
        letters = "".join(inputs)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return inputs, out


@dispatch.handles_local_order
def embedding(a, node: fx.Node) -> Layout:
    materialize_all(a, node)
    indices, weight = node.args[0], node.args[1]
    if a.layout(weight) != REPLICATE:
        return a.refuse(node, "looks up a table that holds sequence data", "Keep embedding tables replicated")
    return a.layout(indices)


@dispatch.handles_local_order
def one_hot(a, node: fx.Node) -> Layout:
    return a.layout(node.args[0])


@handles_split
def convolution(a, node: fx.Node) -> Decided:
    """conv1d / conv2d / conv3d and their transposes over [N, C, *spatial]. Along the spatial dims each
    output reads neighbours, which at a shard's edge live on the next rank. A grouped convolution whose
    groups divide by P (a depthwise causal convolution, as in Mamba and gated-delta layers) runs on the
    whole sequence for a block of the groups (Note [Redistribution]); any other with stride 1 along the
    sequence runs on this rank's positions from a window with the neighbours' boundary rows (Note
    [Windows of the sequence] in ops.py)."""
    materialize_all(a, node)
    source = node.args[0]
    layout = a.layout(source)
    if layout.is_split and layout.split != 1:
        layout = a.sequence_home(source)
    if not layout.is_split and not any(d >= 2 for d in layout.dims):
        return layout
    args = bind(node, conv_signature(node))
    groups, world = args.get("groups"), a.context.shard.world
    window = _window(a, node, args, layout)
    windowed = isinstance(window, ConvolutionWindow)
    blocks = op_name(node).startswith("conv") and isinstance(groups, int) and groups % world == 0
    if blocks and not (windowed and a.windows_first):  # Note [Windows or blocks] in sp_pass.py
        operands = [Operand(source, {d: d for d in range(ndim(source))}), Operand(args["weight"], {0: 1})]
        if isinstance(args["bias"], fx.Node):
            operands.append(Operand(args["bias"], {0: 1}))
        regrouped = align(a, operands, 1, ndim(node))
        if regrouped is not None:
            return decide(regrouped, SplitConvolution(groups // world))
    if windowed:
        return decide(layout, window)
    return a.refuse(
        node,
        f"convolves along the sequence ({window}), and its groups ({groups}) do not divide by "
        f"sp_size={world} to run it on the whole sequence for a block of the channels",
        "Use stride 1 along the sequence, or a depthwise or grouped convolution with groups divisible by "
        "sp_size, or convolve in the data pipeline",
    )


def _window(a, node: fx.Node, args: dict, layout: Layout) -> ConvolutionWindow | str:
    """How to run ``node`` on this rank's output positions from a window of its input, or why not."""
    name = op_name(node)
    if "transpose" in name:
        return "a transposed convolution spreads each input over several outputs"
    if not layout.is_shard or len(layout.dims) != 1 or layout.flat:
        return f"its input is {layout}, not one unflattened sequence dim"
    if not a.context.shard.is_contiguous:
        return "the shards are not contiguous ranges of the sequence (a ring layout)"
    spatial_dims = ndim(args["weight"]) - 2
    dim = layout.dims[0]
    spatial = dim - (ndim(args["input"]) - spatial_dims)
    if spatial < 0:
        return "the sequence is its channel dim"

    def along(value: object) -> object:
        return value[spatial] if isinstance(value, (tuple, list)) else value

    stride, dilation, padding = along(args["stride"]), along(args["dilation"]), args["padding"]
    if stride != 1:
        return f"stride {stride} along it"
    extent = dilation * (int(meta_value(args["weight"]).shape[2 + spatial]) - 1)
    if padding == "valid":
        before = after = 0
    elif padding == "same":
        if spatial_dims > 1:
            return "padding='same' over several spatial dims"
        before, after = extent // 2, extent - extent // 2
    else:
        before = after = along(padding)
    return ConvolutionWindow(dim, spatial, before, after, extent)


def conv_signature(node: fx.Node) -> inspect.Signature:
    return _CONV_SIGNATURES.get(op_name(node), _CONV_SIGNATURES["conv1d"])


_CONV_SIGNATURES = {
    name: inspect.signature(
        lambda input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1: None  # noqa: A006
    )
    for name in ("conv1d", "conv2d", "conv3d")
} | {
    name: inspect.signature(
        lambda input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1: None  # noqa: A006
    )
    for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
}


# --------------------------------------------------------------------------------------------------
# attention


def sdpa(a, node: fx.Node) -> Decided:
    args = bind(node, SDPA_SIGNATURE)  # once: lowering reads the AttentionCall below
    query, key, value, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    layouts = [a.layout(t) for t in (query, key, value)]
    if all(layout == REPLICATE for layout in layouts):
        return REPLICATE if a.layout(mask) in (REPLICATE, CAUSAL) else _refuse_mask(a, node)
    seq = ndim(query) - 2
    if any(layout != shard(seq) for layout in layouts):
        return a.refuse(
            node,
            f"attends with q/k/v of layouts {[str(layout) for layout in layouts]}; only "
            "self-attention over the "
            f"sharded sequence (its dim {seq}) is supported",
            "Attend over the sequence the batch carries (no cross-attention to other sequences)",
        )
    mask_layout = a.layout(mask)
    if mask_layout.kind == "shard" and mask not in a.token_data:
        return _refuse_mask(a, node)
    dropout = args["dropout_p"]
    if a.context.shard.ring_degree > 1 and dropout not in (0, 0.0):  # K/V blocks passed around the ring
        return a.refuse(
            node,
            f"uses attention dropout (dropout_p={dropout}), which ring attention does not support",
            "Set the attention dropout to 0, or use an sp_size (ulysses_degree) that divides the heads",
        )
    if mask_layout == PARTIAL:
        a.materialize(mask)
    length = _derived_length(a, query, seq)
    if length is not None and a.context.shard.ring_degree > 1:
        return a.refuse(
            node,
            f"attends over a sequence of {length} positions, derived from the batch's (ring attention "
            "places whole chunks of the batch's tokens)",
            "Attend over the batch's sequence, or use an sp_size (ulysses_degree) that divides the heads",
        )
    call = AttentionCall(
        query=query,
        key=key,
        value=value,
        mask=mask,
        dropout_p=args["dropout_p"],
        is_causal=bool(args["is_causal"]),
        scale=args["scale"],
        enable_gqa=bool(args["enable_gqa"]),
        heads=meta_value(query).shape[1],
        length=length,
    )
    return decide(shard(seq), call)


def _derived_length(a, tensor: fx.Node, dim: int) -> sympy.Expr | None:
    """``tensor``'s length along ``dim`` where it is derived from the batch's sequence (tokens joined to
    it, a convolution's output), not the sequence's own; None where it is the sequence's."""
    shape = a.shape(tensor)
    length = None if shape is None else shape[dim]
    if not a.has_sequence_symbol(length) or (isinstance(length, sympy.Symbol) and length in a.lengths):
        return None
    return length


def _refuse_mask(a, node: fx.Node) -> Layout:
    return a.refuse(
        node,
        "uses an attention mask computed from activations or parameters, which cannot be rebuilt for "
        "the whole sequence",
        "Build masks from sizes or per-token inputs (positions, document ids, padding), or use "
        "is_causal=True",
    )


def flash(a, node: fx.Node) -> Decided:
    match = a.flash_matches.get(node)
    if match is None and any(r.node is node for r in a.refusals):
        return REFUSED  # find_flash_attention said why
    if match is None and op_name(node) == "autograd_function_apply":
        return elementwise_function(a, node)
    if match is None:
        return a.refuse(node, "is an attention kernel the SP pass does not know", ATTENTION_FIX)
    refusal = flash_refusal(match, a.context)
    if refusal is not None:
        return a.refuse(node, *refusal)
    layouts = [a.layout(match.operands[name]) for name in ("q", "k", "v")]
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if name in match.operands and a.layout(match.operands[name]) != REPLICATE:
            return a.refuse(
                node,
                f"{name} is computed from the sequence (this rank's shard), but after the all-to-all "
                "attention runs over the whole row",
                "Put the cu_seqlens of the whole packed row in the batch (one row per batch)",
            )
    seq = match.seq_dim
    if any(layout.flat for layout in layouts):
        return a.refuse(
            node,
            "flash_attn_varlen_func over a batch flattened to B * S_r tokens",
            "Use one packed row per batch (batch size 1) and mark its documents with cu_seqlens",
        )
    if any(layout != shard(seq) for layout in layouts):
        return a.refuse(node, f"flash-attn with q/k/v of layouts {[str(x) for x in layouts]}", ATTENTION_FIX)
    length = _derived_length(a, match.operands["q"], seq)
    if length is not None:
        return a.refuse(
            node,
            f"runs flash-attn over a sequence of {length} positions, derived from the batch's (tokens "
            "joined to it, a convolution's output)",
            "Use F.scaled_dot_product_attention there, or join the tokens in the data pipeline",
        )
    value = meta_value(node)
    count = len(value) if isinstance(value, (tuple, list)) else 1
    return decide((shard(seq),) * count if isinstance(value, (tuple, list)) else shard(seq), match)


def refuse_subgraph(a, node: fx.Node) -> Layout:
    return a.refuse(
        node,
        "runs sequence data through a region the pass cannot see into (a custom autograd.Function, "
        "torch.cond, a loop)",
        "Write the custom Function's math inline (its backward comes from autograd), or take the branch "
        "outside the compiled step",
    )


def refuse_attention_weights(a, node: fx.Node) -> Layout:
    """What ``normalize.py`` left of ``multi_head_attention_forward``: weights used, or its rarer options."""
    return a.refuse(
        node,
        "is nn.MultiheadAttention returning attention weights that are used, or with bias_k/bias_v, "
        "add_zero_attn, separate q/k/v projection weights, static keys or cross-attention",
        "Call it with need_weights=False (the [L, S] weights are what sequence parallelism avoids "
        "materializing), or write the attention with F.scaled_dot_product_attention",
    )
