"""The sequence-parallel (SP) pass over a Dynamo graph.

Each rank's graph is traced on its own sequence shard [B, S_r, ...] (Note [Sequence sharding] in
``data.py``). The graph computes the right thing per token except where tokens meet: attention,
positions, masks, shifts across shard boundaries and reductions over the sequence. Each pass below
fixes one of those, so that every rank computes exactly its part of the single-device result:

1. ``insert_all_to_all_pass``: attention sees the whole sequence for a slice of the heads.
2. ``globalize_positions_pass``: ``arange`` positions become this rank's global positions.
3. ``globalize_sequence_slices_pass``: slices and pads along the sequence (the causal label shift)
   are taken of the global sequence, fetching the boundary element from the next rank.
4. ``globalize_loss_pass``: mean losses over valid tokens become the mean over the whole sequence.

Every pass is a function ``GraphModule -> GraphModule`` that rewrites in place, records what it did
in a ``SPReport`` and recompiles only when it changed something.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.node import map_aggregate

from lightning_autosp.compiler import ops  # noqa: F401  (registers torch.ops.autosp)
from lightning_autosp.compiler.analysis import (
    _CROSS_ENTROPY_SIGNATURE,
    _SDPA_SIGNATURE,
    AttentionMatch,
    SeqLayout,
    bind,
    example_value,
    find_attention,
    find_manual_attention,
    find_sharded_inputs,
    index_position,
    is_cross_entropy,
    is_sequence_pad,
    is_sequence_slice,
    non_sequence_sizes,
    propagate_sequence_layout,
)
from lightning_autosp.compiler.ring import fetch_plan, ring_args
from lightning_autosp.data import SequenceShard

log = logging.getLogger(__name__)

_GLOBAL_MASK = "autosp_global_mask"


@dataclass
class SPReport:
    """What the SP pass did to one graph, for ``AutoSPStrategy.explain()`` and tests."""

    attention: list[str] = field(default_factory=list)
    all_to_alls: int = 0
    ring_attention: list[str] = field(default_factory=list)
    replicated_kv_heads: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    positions: list[str] = field(default_factory=list)
    slices: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"attention nodes: {len(self.attention)} ({', '.join(self.attention) or 'none'})"]
        out.append(f"all-to-alls inserted: {self.all_to_alls}")
        for title, items in (
            ("ring attention (K/V passed around the ring group)", self.ring_attention),
            ("KV heads replicated", self.replicated_kv_heads),
            ("cast to attention's dtype before the all-to-all", self.casts),
            ("masks rebuilt at global length", self.masks),
            ("positions made global", self.positions),
            ("sequence slices/pads made global", self.slices),
            ("losses made global", self.losses),
        ):
            if items:
                out.append(f"{title}: {', '.join(items)}")
        return out


@dataclass(frozen=True)
class SPContext:
    """What every pass needs to know about this rank."""

    shard: SequenceShard
    group_name: str
    seq_dim: int = 1
    # With ring_degree > 1: the sub-groups of the sp group (Note [Ring layouts] in data.py).
    ulysses_group_name: str | None = None
    ring_group_name: str | None = None

    def check_unambiguous(self, other_sizes: set[int], what: str) -> None:
        """Sequence sizes are recognized by value: refuse when another batch dim has the same value."""
        # Every rank's shard length is checked, so all ranks refuse alike and none waits in a collective.
        clashes = sorted(set(self.shard.seq_lens) & other_sizes)
        if clashes:
            raise ValueError(
                f"The per-rank sequence length ({clashes[0]}) equals another dimension of the "
                f"batch (sizes {sorted(other_sizes)}), so the SP pass cannot tell which sizes in {what} are "
                "sequence lengths. Use a batch size that differs from sequence_length / sp_size."
            )

    @property
    def comm_args(self) -> tuple[list[int], int, str]:
        return list(self.shard.seq_lens), self.shard.rank, self.group_name

    @property
    def ulysses_comm_args(self) -> tuple[list[int], int, str]:
        """The all-to-all's arguments over this rank's Ulysses group (all of sp when ring_degree is 1)."""
        if self.shard.ring_degree == 1:
            return self.comm_args
        return list(self.shard.ulysses_seq_lens), self.shard.ulysses_rank, self.ulysses_group_name


def sequence_parallel_pass(
    gm: fx.GraphModule, example_inputs: Sequence[object], ctx: SPContext, report: SPReport | None = None
) -> tuple[fx.GraphModule, SPReport]:
    """Run the SP passes in order on one (sub-)graph."""
    # flash.py builds on this module's helpers, so it is imported where it is used.
    from lightning_autosp.compiler.flash import insert_flash_all_to_all_pass

    report = report if report is not None else SPReport()
    sharded = find_sharded_inputs(gm, example_inputs, ctx.shard, ctx.seq_dim)
    layouts, derived = propagate_sequence_layout(gm, sharded)
    other_sizes = non_sequence_sizes(sharded)
    manual = [n.name for n in find_manual_attention(gm, ctx.shard.local_len) if n in derived]
    if manual:
        raise NotImplementedError(
            f"Hand-written attention (softmax over a [.., S_r, S_r] score matrix at {', '.join(manual)}) "
            "would only see this rank's tokens. Compute attention with "
            "torch.nn.functional.scaled_dot_product_attention so the SP pass can rewrite it."
        )
    check_layout_supported(gm, ctx, derived)
    globalize_split_masks_pass(gm, example_inputs, ctx, report, derived=derived, other_sizes=other_sizes)
    insert_all_to_all_pass(gm, ctx, report, derived=derived, other_sizes=other_sizes)
    insert_flash_all_to_all_pass(gm, ctx, report, derived=derived)
    gm.graph.eliminate_dead_code()  # the per-rank masks replaced by global ones
    globalize_positions_pass(gm, ctx, report, other_sizes=other_sizes)
    globalize_sequence_slices_pass(gm, ctx, report, layouts=layouts)
    globalize_loss_pass(gm, ctx, report, derived=derived)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm, report


def check_layout_supported(gm: fx.GraphModule, ctx: SPContext, derived: set[fx.Node]) -> None:
    """Refuse what assumes the shards concatenate, in rank order, to the sequence, under a layout of
    several ranges per rank (zigzag, Note [Ring layouts]): flash-attn calls (their all-to-all spans
    all of sp) and masks rebuilt from gathered per-token inputs (packed sequences)."""
    if ctx.shard.is_contiguous:
        return
    from lightning_autosp.compiler.flash import find_flash_attention  # builds on this module
    from lightning_autosp.compiler.packed import is_token_mask

    output = next(n for n in gm.graph.nodes if n.op == "output")
    names = [m.name for m in find_flash_attention(gm)]
    names += [m.node.name for m in find_attention(gm) if m.attn_mask is not None and m.attn_mask in derived]
    names += [v.name for v in output.all_input_nodes if v in derived and is_token_mask(v, derived)]
    if names:
        raise NotImplementedError(
            f"{', '.join(names)}: flash-attn calls and masks built from per-token inputs (packed sequences) "
            "are not supported with ring_layout='zigzag' yet. Use AutoSPStrategy(ring_layout='contiguous')."
        )


# --------------------------------------------------------------------------------------------------
# 1. attention


def insert_all_to_all_pass(
    gm: fx.GraphModule,
    ctx: SPContext,
    report: SPReport,
    *,
    derived: set[fx.Node],
    other_sizes: set[int] = frozenset(),
) -> fx.GraphModule:
    """Give attention the whole sequence for H/P of the heads.

    Before::

        q, k, v [B, H, S_r, D] -> sdpa(is_causal | attn_mask [S_r, S_r]) -> [B, H, S_r, D]

    After::

        q, k, v [B, H, S_r, D] -> seq_to_head -> [B, H/P, S, D]
            -> sdpa(is_causal | attn_mask [S, S]) -> [B, H/P, S, D] -> head_to_seq -> [B, H, S_r, D]

    K/V with fewer heads than can be split over P (GQA, H_kv % P != 0) are first repeated to
    lcm(H_kv, P) heads, which keeps every q head paired with its own KV head.

    With ring_degree R > 1, P is the Ulysses degree U = sp_size / R: the all-to-all runs over the U
    ranks of this rank's ring rank, and ring attention over the R ring ranks takes SDPA's place::

        q, k, v [B, H, S_r, D] -> seq_to_head -> [B, H/U, L_i, D] -> ring_attention -> [B, H/U, L_i, D]
            -> head_to_seq -> [B, H, S_r, D]         (L_i: ring rank i's tokens, Note [Ring layouts])

    Raises:
        ValueError: the q heads do not divide by sp_size (by the Ulysses degree under ring attention).
        NotImplementedError: the attention mask depends on per-token inputs.
    """
    world = ctx.shard.ulysses_degree
    graph = gm.graph
    for match in find_attention(gm):
        q_val, k_val = example_value(match.query), example_value(match.key)
        heads, kv_heads = q_val.shape[match.head_dim], k_val.shape[match.head_dim]
        if heads % world:
            raise ValueError(_heads_error(ctx.shard, heads, match.node.name))
        if q_val.shape[match.seq_dim] != ctx.shard.local_len:
            raise NotImplementedError(
                f"Attention {match.node.name} has {q_val.shape[match.seq_dim]} query positions but this "
                f"rank holds {ctx.shard.local_len} tokens: only self-attention over the sharded sequence "
                "is supported."
            )
        args = bind(match.node, _SDPA_SIGNATURE)
        with graph.inserting_before(match.node):
            key, value = match.key, match.value
            unrepeated = _before_kv_repeat(match)
            if unrepeated is not None:
                # Send the K/V heads the model has, not its copies; SDPA pairs the heads (enable_gqa).
                key, value = unrepeated
                kv_heads = example_value(key).shape[match.head_dim]
                args["enable_gqa"] = True
                report.replicated_kv_heads.append(
                    f"{match.node.name}: K/V sent with their {kv_heads} heads, paired by enable_gqa"
                )
            if kv_heads % world:
                repeats = world // math.gcd(kv_heads, world)
                key = _call(graph, torch.repeat_interleave, (key, repeats), {"dim": match.head_dim})
                value = _call(graph, torch.repeat_interleave, (value, repeats), {"dim": match.head_dim})
                report.replicated_kv_heads.append(f"{match.node.name}: {kv_heads} -> {kv_heads * repeats}")
            dims = (match.head_dim, match.seq_dim)
            q, k, v = (
                _call(graph, torch.ops.autosp.seq_to_head.default, (t, *dims, *ctx.ulysses_comm_args))
                for t in _in_attention_dtype(graph, match, (match.query, key, value), report)
            )
            mask = args["attn_mask"]
            if mask is not None:
                ctx.check_unambiguous(other_sizes, f"the attention mask of {match.node.name}")
            if (
                mask is not None
                and mask not in derived
                and (_from_causal_marker(mask) or is_causal_mask(gm, mask, ctx))
            ):
                # An S x S mask per rank would grow with the global length; is_causal needs none.
                mask, args["is_causal"] = None, True
                report.masks.append(f"{match.node.name}: causal mask -> is_causal=True")
            elif mask is not None:
                mask = _global_mask(graph, mask, ctx, heads, derived, match)
                report.masks.append(f"{match.node.name}: {mask.name}")
        args.update(query=q, key=k, value=v, attn_mask=mask)
        match.node.args = (q, k, v)
        match.node.kwargs = {
            name: args[name] for name in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        }
        _set_fake_value(match.node)  # now [B, H/P, S, D]
        attention = match.node
        if ctx.shard.ring_degree > 1:
            attention = _lower_to_ring_attention(graph, match, ctx)
            report.ring_attention.append(match.node.name)
        with graph.inserting_after(attention):
            back = _call(
                graph, torch.ops.autosp.head_to_seq.default, (attention, *dims, *ctx.ulysses_comm_args)
            )
        _redirect_uses(attention, back)
        report.attention.append(match.node.name)
        report.all_to_alls += 4
    return gm


def _in_attention_dtype(
    graph: fx.Graph, match: AttentionMatch, tensors: tuple[fx.Node, ...], report: SPReport
) -> tuple[fx.Node, ...]:
    """Cast q, k, v to the dtype attention computes in before they cross the all-to-all.

    Under autocast, attention casts its inputs to the autocast dtype; HF's rotary embeddings leave q
    and k in float32 (cos and sin are float32), which would double their all-to-all bytes and their
    saved copies. An all-to-all only moves elements, so casting before it is what autocast would do
    after it. Attention's traced output dtype differs from an input's only when autocast casts.
    """
    compute_dtype = example_value(match.node).dtype
    cast = []
    for tensor in tensors:
        if example_value(tensor).dtype != compute_dtype:
            report.casts.append(f"{tensor.name} {example_value(tensor).dtype} -> {compute_dtype}")
            tensor = _call(graph, torch.Tensor.to, (tensor, compute_dtype))
        cast.append(tensor)
    return tuple(cast)


def _repeat_source(node: fx.Node, head_dim: int) -> tuple[fx.Node, int] | None:
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
    if original.dim() != 4 or middle.dim() != 5 or middle.shape[head_dim + 1] != 1:
        return None
    repeats = expanded.shape[head_dim + 1]
    expected = list(original.shape)
    expected[head_dim] *= repeats
    unsqueezed_shape = [*original.shape[: head_dim + 1], 1, *original.shape[head_dim + 1 :]]
    if list(out.shape) != expected or list(middle.shape) != unsqueezed_shape:
        return None
    return source, repeats


def _before_kv_repeat(match: AttentionMatch) -> tuple[fx.Node, fx.Node] | None:
    """K and V before a ``repeat_kv`` in front of SDPA, when both repeat alike and nothing else uses them."""
    if match.head_dim != 1 or bind(match.node, _SDPA_SIGNATURE)["enable_gqa"]:
        return None
    key, value = _repeat_source(match.key, 1), _repeat_source(match.value, 1)
    if key is None or value is None or key[1] != value[1] or key[1] < 2:
        return None
    if len(match.key.users) != 1 or len(match.value.users) != 1:
        return None
    return key[0], value[0]


def _heads_error(shard: SequenceShard, heads: int, name: str) -> str:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    if shard.ring_degree == 1:
        return (
            f"sp_size={shard.world} must divide the number of attention heads ({heads}) of {name}; "
            f"use one of {divisors}, or AutoSPStrategy(ulysses_degree='auto') to run the rest of sp as "
            "ring attention."
        )
    usable = [d for d in divisors if shard.world % d == 0]
    return (
        f"ulysses_degree={shard.ulysses_degree} must divide the number of attention heads ({heads}) of "
        f"{name}; use ulysses_degree='auto' or one of {usable}."
    )


def _lower_to_ring_attention(graph: fx.Graph, match: AttentionMatch, ctx: SPContext) -> fx.Node:
    """Replace the (all-to-all'd) SDPA call by ring attention over the ring group; returns its output.

    ``enable_gqa`` needs no flag: the ring op pairs q head h with K/V head h // (H / H_kv) as SDPA does.
    """
    sdpa = match.node
    args = bind(sdpa, _SDPA_SIGNATURE)
    if args["dropout_p"] not in (0, 0.0):
        raise NotImplementedError(
            f"{sdpa.name}: attention dropout (dropout_p={args['dropout_p']}) is not supported with ring "
            "attention; set the attention dropout to 0, or use an sp_size that divides the heads."
        )
    mask = example_value(args["attn_mask"])
    if mask is not None and mask.requires_grad:
        raise NotImplementedError(
            f"{sdpa.name}: an attention mask that needs a gradient (a learned bias) is not supported with "
            "ring attention; use an sp_size that divides the heads."
        )
    bounds, range_counts, ring_rank = ring_args(ctx.shard)
    operands = (args["query"], args["key"], args["value"], args["attn_mask"], bool(args["is_causal"]))
    with graph.inserting_before(sdpa):
        pair = _call(
            graph,
            torch.ops.autosp.ring_attention.default,
            (*operands, args["scale"], bounds, range_counts, ring_rank, ctx.ring_group_name),
        )
        out = _call(graph, operator.getitem, (pair, 0))
    sdpa.replace_all_uses_with(out)
    graph.erase_node(sdpa)
    return out


_MAX_PROBE_ENTRIES = 1 << 24


def is_causal_mask(gm: fx.GraphModule, mask: fx.Node, ctx: SPContext) -> bool:
    """Whether ``mask``, built from sizes alone, is the plain causal mask (HF builds one so).

    The mask's producers are evaluated at a probe length n: S itself when S x S is small, else a
    length past every integer constant in them, so that a sliding window or an offset shows up as a
    difference from ``tril``. Boolean masks must equal ``tril``; additive ones must be 0 on it and
    at most half the dtype's minimum off it (exp() of that is exactly 0 against any real score).
    """
    producers = _ancestors(mask)
    if any(n.op == "placeholder" for n in producers):
        return False
    local, total = ctx.shard.local_len, ctx.shard.global_len
    constants = [abs(c) for n in producers for c in _ints((n.args, n.kwargs)) if c != local]
    probe = min(total, max(16, 2 * max(constants, default=0) + 2))
    if probe * probe > _MAX_PROBE_ENTRIES:
        log.info("mask %s: not probed for causality (probe length %d too long); kept dense", mask, probe)
        return False
    graph = fx.Graph()
    copies = _copy_at_length([n for n in gm.graph.nodes if n in producers], graph, local, probe)
    graph.output(copies[mask])
    try:
        with unset_fake_temporarily(), torch.no_grad():
            value = fx.GraphModule(gm, graph)()
    except Exception as error:  # a producer that needs its traced context: keep the dense mask
        log.info("mask %s: could not be evaluated at length %d (%s); kept dense", mask, probe, error)
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (probe, probe):
        return False
    causal = torch.ones(probe, probe, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == causal).all())
    if not value.is_floating_point():
        return False
    blocked = value <= torch.finfo(value.dtype).min / 2
    return bool(((value == 0) == causal).all() and (blocked != causal).all())


def _ints(value: object) -> list[int]:
    found: list[int] = []
    map_aggregate(value, lambda v: found.append(v) if type(v) is int else None)  # bools are not sizes
    return found


def _global_mask(
    graph: fx.Graph, mask: fx.Node, ctx: SPContext, heads: int, derived: set[fx.Node], match: AttentionMatch
) -> fx.Node:
    """Rebuild the mask's producers for the global length: every size S_r in them becomes S.

    Masks are built from shapes (``torch.ones(T, T).triu()``, a buffer sliced ``[:T, :T]``,
    ``arange`` comparisons): a copy of that sub-graph with S_r replaced by S gives the mask the
    attention sees after the all-to-all. The copy leaves the originals to their other users.
    A mask computed from per-token inputs (packed documents) is rebuilt from their gathered values.
    """
    local = ctx.shard.local_len
    if local < 2:
        raise NotImplementedError(
            f"Each sp rank holds {local} token(s); masks need at least 2 per rank to be rebuilt. "
            "Use longer sequences or a smaller sp_size."
        )
    if mask in derived:
        from lightning_autosp.compiler.packed import globalize_token_mask  # builds on this module

        global_mask = globalize_token_mask(graph, mask, ctx, derived, user=match.node.name)
    else:
        global_mask = _rebuild_at_global_length(graph, mask, ctx)
    value = example_value(mask)
    if value is not None and value.dim() == 4 and value.shape[1] == heads and heads > 1:
        per_rank = heads // ctx.shard.ulysses_degree
        start = ctx.shard.ulysses_rank * per_rank
        index = (slice(None), slice(start, start + per_rank))
        global_mask = _call(graph, operator.getitem, (global_mask, index))
    return global_mask


def _rebuild_at_global_length(
    graph: fx.Graph, node: fx.Node, ctx: SPContext, inputs: dict[fx.Node, fx.Node] | None = None
) -> fx.Node:
    """A copy of ``node``'s producers (at the insertion point) with every size S_r replaced by S.

    ``inputs`` replaces graph inputs in the copy (per-token inputs by their gathered values).
    """
    producers = _ancestors(node)
    computed = [n for n in graph.nodes if n in producers and n.op not in ("placeholder", "get_attr")]
    copies = _copy_at_length(
        computed, graph, ctx.shard.local_len, ctx.shard.global_len, dict(inputs or {}), {_GLOBAL_MASK: True}
    )
    return copies.get(node, node)


def _copy_at_length(
    nodes: list[fx.Node],
    into: fx.Graph,
    old: int,
    new: int,
    copies: dict[fx.Node, fx.Node] | None = None,
    meta: dict | None = None,
) -> dict[fx.Node, fx.Node]:
    """Copy ``nodes`` (in graph order) into ``into`` with every integer ``old`` in their arguments
    replaced by ``new``; returns original -> copy. ``copies`` supplies replacements for inputs;
    arguments with none are used as they are. ``meta``, if given, replaces each copy's meta."""
    copies = {} if copies is None else copies
    for node in nodes:
        copy = into.node_copy(node, lambda n: copies.get(n, n))
        copy.args = _replace_int(copy.args, old, new)
        copy.kwargs = _replace_int(copy.kwargs, old, new)
        if meta is not None:
            copy.meta = dict(meta)
        copies[node] = copy
    return copies


_MASK_BUILDERS = {"triu", "tril", "masked_fill", "where", "full", "le", "lt", "ge", "gt"}


def _is_local_square(value: torch.Tensor | None, ctx: SPContext) -> bool:
    local = ctx.shard.local_len
    return value is not None and value.dim() >= 2 and tuple(value.shape[-2:]) == (local, local)


def _looks_like_mask(node: fx.Node) -> bool:
    if example_value(node).dtype == torch.bool:
        return True
    names = {getattr(n.target, "__name__", str(n.target)) for n in _ancestors(node)}
    return bool(names & _MASK_BUILDERS)


def globalize_split_masks_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    ctx: SPContext,
    report: SPReport,
    *,
    derived: set[fx.Node],
    other_sizes: set[int] = frozenset(),
) -> fx.GraphModule:
    """Hand attention masks between sub-graphs at the global length.

    DDP's graph splitting can put a mask's producers (HF builds one mask for all layers) and the
    attentions that use it in different sub-graphs, each rewritten on its own. Both sides follow one
    rule: a mask-shaped [..., S_r, S_r] value computed without per-token data leaves a sub-graph
    rebuilt as [..., S, S] (producer side), and such a graph input that feeds an attention mask is
    taken to arrive as [..., S, S] (consumer side; its example input is replaced to match).

    Before: ``graph_0: mask [S_r, S_r] -> output``; ``graph_1: mask [S_r, S_r] -> sdpa``.
    After:  ``graph_0: mask [S, S] -> output``;     ``graph_1: mask [S, S] -> a2a'd sdpa``.
    """
    from lightning_autosp.compiler.packed import globalize_token_mask, is_token_mask  # builds on this module

    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    rebuilt: dict[fx.Node, fx.Node] = {}
    for value in output.all_input_nodes:
        local_mask = _is_local_square(example_value(value), ctx) and _looks_like_mask(value)
        if value.op != "placeholder" and value not in derived and local_mask:
            ctx.check_unambiguous(other_sizes, f"the mask {value.name}")
            with graph.inserting_before(output):
                if is_causal_mask(gm, value, ctx):
                    rebuilt[value] = _causal_marker(graph, example_value(value), ctx)
                    report.masks.append(f"{value.name}: causal, handed on as an empty marker")
                else:
                    rebuilt[value] = _rebuild_at_global_length(graph, value, ctx)
                    report.masks.append(f"{value.name}: handed on at global length")
        elif value.op != "placeholder" and local_mask and is_token_mask(value, derived):
            ctx.check_unambiguous(other_sizes, f"the mask {value.name}")
            rebuilt[value] = globalize_token_mask(graph, value, ctx, derived, user="the next graph")
            report.masks.append(f"{value.name}: handed on at global length, from gathered per-token inputs")
    if rebuilt:
        output.args = torch.fx.node.map_arg(output.args, lambda n: rebuilt.get(n, n))

    mask_inputs = set().union(
        *(_ancestors(m.attn_mask) for m in find_attention(gm) if m.attn_mask is not None)
    )
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        value = example_value(node)
        if node in mask_inputs and _is_causal_marker(example, ctx):
            node.meta["example_value"] = example
            node.meta[_CAUSAL_MARKER] = True
            report.masks.append(f"{node.name}: received as a causal marker")
            continue
        if node in mask_inputs and node not in derived and _is_local_square(value, ctx):
            shape = (*value.shape[:-2], ctx.shard.global_len, ctx.shard.global_len)
            mode = getattr(example, "fake_mode", None) or getattr(value, "fake_mode", None)
            if mode is None:  # a real input: it arrives as it is, nothing to re-trace
                continue
            with mode:
                global_value = torch.empty(shape, dtype=value.dtype, device=value.device)
            node.meta["example_value"] = global_value
            if isinstance(example, torch.Tensor) and isinstance(example_inputs, list):
                example_inputs[index] = global_value
            report.masks.append(f"{node.name}: received at global length")
    return gm


_CAUSAL_MARKER = "autosp_causal_marker"


def _causal_marker(graph: fx.Graph, mask: torch.Tensor, ctx: SPContext) -> fx.Node:
    """An empty [..., 0, S] stand-in for a causal mask handed to the next sub-graph.

    The next graph cannot tell a causal mask from its values at trace time; an empty tensor of this
    shape (which no mask has) says so, and costs nothing at run time.
    """
    shape = (*mask.shape[:-2], 0, ctx.shard.global_len)
    return _call(graph, torch.empty, (shape,), {"dtype": mask.dtype, "device": mask.device})


def _is_causal_marker(example: object, ctx: SPContext) -> bool:
    return (
        isinstance(example, torch.Tensor)
        and example.dim() >= 2
        and tuple(example.shape[-2:]) == (0, ctx.shard.global_len)
    )


def _from_causal_marker(mask: fx.Node) -> bool:
    """Whether ``mask`` is (a view of) a received causal marker and nothing else."""
    inputs = [n for n in _ancestors(mask) if n.op == "placeholder"]
    return bool(inputs) and all(n.meta.get(_CAUSAL_MARKER) for n in inputs)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return seen


def _replace_int(value: object, old: int, new: int) -> object:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return new if value == old else value
    if isinstance(value, slice):
        return slice(*(_replace_int(v, old, new) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list)):
        return type(value)(_replace_int(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: _replace_int(v, old, new) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------------
# 2. positions


def globalize_positions_pass(
    gm: fx.GraphModule, ctx: SPContext, report: SPReport, *, other_sizes: set[int] = frozenset()
) -> fx.GraphModule:
    """Positions from ``arange`` count from this rank's first global position.

    Before: ``pos = arange(S_r)`` -> [0, ..., S_r - 1]
    After:  ``pos = arange(o_r, o_r + S_r)`` -> [o_r, ..., o_r + S_r - 1], o_r = sum of earlier shards.
    A shard of several ranges (zigzag, Note [Ring layouts]) gets ``cat([arange(a, b), ...])``.
    """
    local = ctx.shard.local_len
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.arange or node.meta.get(_GLOBAL_MASK):
            continue
        start, end, step, kwargs = _arange_args(node)
        if (start, end, step) != (0, local, 1):
            continue
        ctx.check_unambiguous(other_sizes, f"arange({local})")
        if len(ctx.shard.ranges) > 1:
            _replace_by_ranges(gm.graph, node, ctx.shard, kwargs)
            report.positions.append(f"{node.name}: arange({local}) -> positions {list(ctx.shard.ranges)}")
            continue
        offset = ctx.shard.ranges[0][0]
        node.args, node.kwargs = (offset, offset + local), kwargs
        report.positions.append(f"{node.name}: arange({local}) -> arange({offset}, {offset + local})")
    return gm


def _replace_by_ranges(graph: fx.Graph, node: fx.Node, shard: SequenceShard, kwargs: dict) -> None:
    with graph.inserting_before(node):
        pieces = [_call(graph, torch.arange, (start, end), kwargs) for start, end in shard.ranges]
        positions = _call(graph, torch.cat, (pieces,))
    for inserted in (*pieces, positions):
        inserted.meta[_GLOBAL_MASK] = True
        _set_fake_value(inserted)
    node.replace_all_uses_with(positions)
    graph.erase_node(node)


def _arange_args(node: fx.Node) -> tuple[object, object, object, dict]:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if len(args) == 1 and "end" not in kwargs:
        args = [0, args[0]]
    start = args[0] if args else kwargs.pop("start", 0)
    end = args[1] if len(args) > 1 else kwargs.pop("end", None)
    step = args[2] if len(args) > 2 else kwargs.pop("step", 1)
    kwargs.pop("start", None), kwargs.pop("end", None), kwargs.pop("step", None)
    return start, end, step, kwargs


# --------------------------------------------------------------------------------------------------
# 3. slices, shifts and pads along the sequence


def globalize_sequence_slices_pass(
    gm: fx.GraphModule, ctx: SPContext, report: SPReport, *, layouts: dict[fx.Node, SeqLayout]
) -> fx.GraphModule:
    """Take slices and pads along the sequence of the global tensor, not of the local shard.

    The causal shift pairs logit t with target t + 1, so the target of a rank's last position is the
    next rank's first token. Before (rank r, global length S)::

        labels [B, S_r] -> labels[:, 1:] -> [B, S_r - 1]          # loses the boundary target

    After (rank r < P-1)::

        labels [B, S_r] -> shift_from_next(labels, start=1) -> [B, S_r]   # = cat(labels[:, 1:], next[:, :1])

    and on the last rank ``labels[:, 1:]`` (it owns positions up to S - 1). Likewise
    ``logits[:, :-1]`` drops a position on the last rank only, and a right pad (HF's
    ``pad(labels, (0, 1), value=-100)``) pads the last rank only.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if is_sequence_slice(node, layouts):
            replacement = _rewrite_slice(graph, node, layouts[node.args[0]], ctx)
        elif is_sequence_pad(node, layouts):
            replacement = _rewrite_pad(graph, node, layouts[node.args[0]], ctx)
        else:
            continue
        # Chained rewrites (HF pads, then shifts) must see the replacement as the same sequence value.
        if node in layouts:
            layouts[replacement] = layouts[node]
        report.slices.append(f"{node.name}: {_describe(node)}")
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    return gm


def _describe(node: fx.Node) -> str:
    return f"{getattr(node.target, '__name__', node.target)}{tuple(str(a) for a in node.args[1:])}"


def _rewrite_slice(graph: fx.Graph, node: fx.Node, layout: SeqLayout, ctx: SPContext) -> fx.Node:
    source, index = node.args
    ndim = example_value(source).dim()
    position = index_position(index, ndim, layout.dim)
    items = list(index) if isinstance(index, tuple) else [index]
    item: slice = items[position]
    start, stop, step = item.indices(layout.global_len)
    if step != 1:
        raise NotImplementedError(
            f"{node.name}: strided slices along the sequence ({item}) are not supported."
        )
    out_len = max(0, stop - start)
    shard = ctx.shard
    if not shard.is_contiguous:
        return _rewrite_slice_by_positions(graph, node, layout, ctx, start, out_len, items, position)

    def plan(rank: int) -> tuple[int, int, int]:
        """(local start, local length, halo length) for ``rank``."""
        other = SequenceShard(shard.global_len, shard.seq_lens, rank)
        lo, hi = other.owned_range(out_len)
        lo_in, hi_in = other.owned_range(layout.global_len)
        need_lo, need_hi = lo + start, hi + start
        local_hi = min(need_hi, hi_in)
        local = max(0, local_hi - need_lo)
        halo = max(0, need_hi - max(hi_in, need_lo))
        return (need_lo - lo_in if local else 0), local, halo

    plans = [plan(r) for r in range(shard.world)]
    halo_count = max(p[2] for p in plans)
    local_start, local_len, halo = plans[shard.rank]
    with graph.inserting_before(node):
        if halo_count:
            if halo_count > min(shard.seq_lens):
                raise NotImplementedError(
                    f"{node.name}: the slice {item} reaches past the next rank's shard "
                    f"({min(shard.seq_lens)} tokens); use longer sequences or a smaller sp_size."
                )
            args = (source, layout.dim, local_start, local_len, halo, halo_count)
            args += (shard.rank, shard.world, ctx.group_name)
            seq_fixed = _call(graph, torch.ops.autosp.shift_from_next.default, args)
        else:
            seq_fixed = _call(graph, torch.narrow, (source, layout.dim, local_start, local_len))
        items[position] = slice(None)
        if all(i == slice(None) or i is Ellipsis for i in items):
            replacement = seq_fixed
        else:
            replacement = _call(graph, operator.getitem, (seq_fixed, tuple(items)))
    return replacement


def _rewrite_slice_by_positions(
    graph: fx.Graph,
    node: fx.Node,
    layout: SeqLayout,
    ctx: SPContext,
    start: int,
    out_len: int,
    items: list,
    position: int,
) -> fx.Node:
    """``x[.., start : start + out_len, ..]`` under a layout of several ranges per rank (zigzag): each
    element comes from this rank's shard or, at a range's end, from the rank holding the next range."""
    export_index, export_count, take = fetch_plan(ctx.shard, layout.global_len, start, out_len)
    source = node.args[0]
    first = take[0] if take else 0
    with graph.inserting_before(node):
        if not export_count and take == list(range(first, first + len(take))):
            # Nothing crosses ranks and this rank's part is one run (``logits[:, :-1]``): a plain narrow.
            seq_fixed = _call(graph, torch.narrow, (source, layout.dim, first, len(take)))
        else:
            args = (source, layout.dim, export_index, export_count, take, ctx.shard.world, ctx.group_name)
            seq_fixed = _call(graph, torch.ops.autosp.fetch_positions.default, args)
        items[position] = slice(None)
        if all(i == slice(None) or i is Ellipsis for i in items):
            return seq_fixed
        return _call(graph, operator.getitem, (seq_fixed, tuple(items)))


def _pad_counts(shard: SequenceShard, in_len: int, out_len: int) -> tuple[int, int, int]:
    """(this rank's input length, how many of its input elements stay, how many pad elements follow)
    when a sequence-derived tensor of ``in_len`` positions is right-padded to ``out_len``."""
    if shard.is_contiguous:
        lo, hi = shard.owned_range(out_len)
        lo_in, hi_in = shard.owned_range(in_len)
        return hi_in - lo_in, min(hi, in_len) - lo, hi - max(lo, in_len)
    # Every rank's positions ascend, so the pad positions (>= in_len) are a suffix of its shard.
    owned = shard.positions(out_len)
    keep = sum(p < in_len for p in owned)
    return len(shard.positions(in_len)), keep, len(owned) - keep


def _rewrite_pad(graph: fx.Graph, node: fx.Node, layout: SeqLayout, ctx: SPContext) -> fx.Node:
    source = node.args[0]
    pads = list(node.args[1] if len(node.args) > 1 else node.kwargs["pad"])
    ndim = example_value(source).dim()
    padded_dim = ndim - 1 - layout.dim
    left, right = pads[2 * padded_dim : 2 * padded_dim + 2]
    if left:
        raise NotImplementedError(
            f"{node.name}: padding at the start of the sequence ({left}) is not supported under SP."
        )
    out_len = layout.global_len + right
    local_in, keep, fill = _pad_counts(ctx.shard, layout.global_len, out_len)
    with graph.inserting_before(node):
        narrowed = source if keep == local_in else _call(graph, torch.narrow, (source, layout.dim, 0, keep))
        pads[2 * padded_dim : 2 * padded_dim + 2] = [0, max(0, fill)]
        if any(pads):
            replacement = _call(graph, F.pad, (narrowed, tuple(pads), *node.args[2:]), dict(node.kwargs))
        else:
            replacement = narrowed
    return replacement


# --------------------------------------------------------------------------------------------------
# 4. losses


def globalize_loss_pass(
    gm: fx.GraphModule, ctx: SPContext, report: SPReport, *, derived: set[fx.Node]
) -> fx.GraphModule:
    """Cross-entropy over sharded tokens becomes the loss over the whole sequence.

    Note [Loss over sequence shards]
        Before: ``loss = cross_entropy(logits [N_r, V], targets [N_r])`` (mean over this rank's
        valid tokens). After::

            total, count = all_reduce_sum(stack([cross_entropy(..., reduction="sum"),
                                                 (targets != ignore_index).sum()]))
            loss = total / count

        so every rank returns the single-device loss; a shard without valid tokens adds 0, not NaN.
        ``all_reduce_sum``'s backward sums the ranks' gradients: each of the P ranks backpropagates
        the same total, so each rank's partial sum receives P times the gradient, and DDP's mean
        over all dp x sp ranks divides that P back out, leaving the mean over dp groups.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_cross_entropy(node) or not any(n in derived for n in node.all_input_nodes):
            continue
        args = bind(node, _CROSS_ENTROPY_SIGNATURE)
        if args["size_average"] is not None or args["reduce"] is not None:
            raise NotImplementedError(
                f"{node.name}: use reduction= instead of the deprecated size_average/reduce."
            )
        reduction, ignore_index = args["reduction"], args["ignore_index"]
        if reduction == "none":
            raise NotImplementedError(
                f"{node.name}: cross_entropy(reduction='none') over sequence shards is not supported yet; "
                "use reduction='mean' (ignore_index for padding) or 'sum'."
            )
        target = example_value(args["target"])
        if reduction == "mean" and (
            args["weight"] is not None or (target is not None and target.is_floating_point())
        ):
            raise NotImplementedError(
                f"{node.name}: a mean cross_entropy with class weights or probability targets is not "
                "supported under SP yet; use reduction='sum' and divide by your own global count."
            )
        group = ctx.group_name
        with graph.inserting_before(node.next):
            if reduction == "sum":
                loss = keep = _call(graph, torch.ops.autosp.all_reduce_sum.default, (node, group))
            else:
                # One collective for sum and count, so ranks cannot issue them in different orders.
                valid = _call(graph, operator.ne, (args["target"], ignore_index))
                local_count = _call(graph, torch.sum, (valid,), {"dtype": example_value(node).dtype})
                keep = _call(graph, torch.stack, ([node, local_count],))
                totals = _call(graph, torch.ops.autosp.all_reduce_sum.default, (keep, group))
                total = _call(graph, operator.getitem, (totals, 0))
                count = _call(graph, operator.getitem, (totals, 1))
                loss = _call(graph, operator.truediv, (total, count))
        _redirect_uses(node, loss, keep=keep)
        if reduction == "mean":
            node.args = (args["input"], args["target"])
            node.kwargs = {k: v for k, v in args.items() if k not in ("input", "target")} | {
                "reduction": "sum"
            }
        report.losses.append(f"{node.name}: {reduction} over {'valid ' if reduction == 'mean' else ''}tokens")
    return gm


# --------------------------------------------------------------------------------------------------


def _redirect_uses(node: fx.Node, replacement: fx.Node, keep: fx.Node | None = None) -> None:
    """Point every user of ``node`` at ``replacement``, except the node that wraps ``node`` itself."""
    keep = keep if keep is not None else replacement
    node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user is not keep)


def _call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` and record its fake value, as Dynamo does for its nodes."""
    node = graph.call_function(target, args, kwargs or {})
    _set_fake_value(node)
    return node


def _set_fake_value(node: fx.Node) -> None:
    fake_args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("example_value"))
    fake_kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("example_value"))
    fake = next((v for v in _flatten([fake_args, fake_kwargs]) if isinstance(v, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in _flatten([fake_args, fake_kwargs])
    )
    try:
        # Without autograd: recording it would call the user's saved-tensor hooks (MemoryMonitor's)
        # from inside the compiler.
        with mode, torch.no_grad():
            value = node.target(*fake_args, **fake_kwargs)
    except Exception as error:  # shapes are a convenience for later passes, not a requirement
        log.debug("no fake value for %s: %s", node.name, error)
        return
    for tensor in _flatten([value]):
        if needs_grad and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            tensor.requires_grad_()
    node.meta["example_value"] = value


def _flatten(value: object) -> list[object]:
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _flatten(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flatten(item)]
    return [value]
