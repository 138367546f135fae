"""Sequence-aware activation checkpointing (SAC) as an AOTAutograd partitioner.

At long sequence lengths attention dominates the FLOPs (attention / linear = S / 6h for a GPT
block), so recomputing linear, MLP, norm and elementwise ops in backward is cheap, while their
activations are most of the memory. PyTorch's min-cut partitioner refuses to recompute matmuls on
its own; tagging them ``PREFER_RECOMPUTE`` lifts that ban for this graph only. Attention outputs
and collectives are tagged ``MUST_SAVE``: attention is the expensive op, and a recomputed
collective would talk to other ranks again in backward.

Parameters sharded by ``data_parallel="fsdp"`` are all-gathered in the graph; those gathers are the one
collective backward re-runs (Note [Gathered parameters in backward] in ``parameter_gathers.py``).

Used through ``torch._inductor.config.custom_partitioner_fn`` (patched for one compile via
``compile_fx(config_patches=...)``) or as AOTAutograd's ``partition_fn``: no process-wide state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import ancestors, forward_nodes, value_of
from lightning_autosp.compiler.partition import (
    memory_policy,
    offload,
    ordering,
    parameter_gathers,
    row_sums,
    tiling,
)
from lightning_autosp.compiler.partition.memory_policy import (
    AttentionRecompute,
    choose_layers,
    kept_bytes,
    layer_saves,
    send_layers,
    values_shared_by_layers,
)
from lightning_autosp.compiler.partition.ordering import order_collectives
from lightning_autosp.compiler.partition.parameter_gathers import (
    cast_before_parameter_gathers,
    is_parameter_all_gather,
    tag_parameter_gathers,
)
from lightning_autosp.compiler.partition.tiling import tile_rows_pass
from lightning_autosp.compiler.partition.tiling_rules import node_bytes
from lightning_autosp.compiler.runtime.ops import is_collective

log = logging.getLogger(__name__)

SACMode = Literal["all", "auto", "longest", "off"]
# Regions SAC rebuilds are run over tiles of rows when their widest inner value is at least this big.
DEFAULT_TILE_BYTES = 1 << 20

_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "ring_attention",  # compiler/runtime/ring.py (its FLOPs here count the local K/V block only)
    "_flash_attn_forward",  # flash-attn 2.x (compiler/prove/flash.py)
    "_flash_attn_varlen_forward",
}
# flash-attn's q/k/v are [B, S, H, D], or [T, H, D] for varlen (FLOPs counted as one document: a bound).
_SEQUENCE_FIRST_ATTENTION_OPS = {"_flash_attn_forward", "_flash_attn_varlen_forward"}


def _op_name(node: fx.Node) -> str:
    overload = getattr(node.target, "_overloadpacket", None)
    return getattr(overload, "__name__", "") if overload is not None else ""


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


_NORMALIZATION_OPS = {"native_layer_norm", "var_mean", "_fused_rms_norm", "rms_norm"}
_CAST_OPS = {"_to_copy", "convert_element_type"}


def _strip_casts(node: object) -> object:
    while isinstance(node, fx.Node) and _op_name(node) in _CAST_OPS:
        node = node.args[0]
    return node


def normalization_input(node: fx.Node) -> fx.Node | None:
    """The tensor a LayerNorm or RMSNorm normalizes, if ``node`` is one; before any dtype cast.

    RMSNorm written out (HF Llama) reaches the graph as ``mean(pow(x, 2), -1)``.
    """
    name = _op_name(node)
    if name in _NORMALIZATION_OPS:
        source = node.args[0]
    elif name == "mean" and isinstance(node.args[0], fx.Node):
        square = node.args[0]
        if not (_op_name(square) == "pow" and square.args[1] == 2) and not (
            _op_name(square) == "mul" and square.args[0] is square.args[1]
        ):
            return None
        source = square.args[0]
    else:
        return None
    source = _strip_casts(source)
    return source if isinstance(source, fx.Node) else None


def layer_boundaries(joint: fx.GraphModule) -> set[fx.Node]:
    """The residual stream where each transformer block starts, and where the head starts: the inputs
    of the pre-attention norms and of the norms after the last attention (the final norm).

    Saving these cuts the recompute chain: without them, rebuilding the last block's activations in
    backward re-runs every block before it, and all of them are alive at once. A norm counts as
    pre-attention when the attention's query depends on it and on no later norm. Block inputs
    that are cheap to rebuild (the embedding) are left to recompute. Saving the head's input makes the
    last block like the others: otherwise backward rebuilds it once for the loss's backward and keeps
    its MLP values until that block's own backward, and they could not be rebuilt tile by tile
    (Note [Row tiling]), since the rebuild would feed the loss that feeds its own gradient.
    """
    forward = forward_nodes(joint)
    normalized = {n: normalization_input(n) for n in forward if n.op == "call_function"}
    sources = {source for source in normalized.values() if source is not None}
    attentions = [n for n in forward if _op_name(n) in _ATTENTION_OPS]
    before_attention = {a for n in attentions for a in ancestors(n)}
    after_attention = [
        n for n, s in normalized.items() if s is not None and attentions and n not in before_attention
    ]
    before_another = {a for n in after_attention for a in ancestors(n) if a is not n}
    final_norms = [n for n in after_attention if n not in before_another]  # not the last block's MLP norm
    boundaries = {normalized[n] for n in final_norms if _costly_to_rebuild(normalized[n])}
    for attention in attentions:
        # Walk back from the query to the first normalized tensor on each path; decomposed norms
        # reach it both through their statistics and directly (x * rsqrt(var)).
        stack, seen = [attention.args[0]], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node in seen:
                continue
            seen.add(node)
            source = normalized.get(node) or (node if node in sources else None)
            if source is not None:
                if _costly_to_rebuild(source):
                    boundaries.add(source)
                continue
            stack.extend(node.all_input_nodes)
    return boundaries


def _costly_to_rebuild(node: fx.Node) -> bool:
    """Whether rebuilding ``node`` from the graph inputs runs a FLOP-counted op or gathers a parameter.

    The first block's input is an embedding lookup: cheap to rebuild when the table is at hand, so not
    worth its bytes; with the table sharded (data_parallel="fsdp") rebuilding it would all-gather the
    whole table again in backward, which costs more than the block input. A graph input (placeholder)
    is held anyway.
    """
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen or current.op != "call_function":
            continue
        seen.add(current)
        if node_flops(current) > 0 or is_parameter_all_gather(current):
            return True
        stack.extend(current.all_input_nodes)
    return False


def recompute_policy(node: fx.Node) -> CheckpointPolicy:
    """Save attention, collectives and random ops; let everything else be recomputed."""
    if _op_name(node) in _ATTENTION_OPS or is_collective(node) or _is_random(node):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def tag_recompute_policy(
    joint: fx.GraphModule, recomputable: set[fx.Node] | None = None, boundaries: set[fx.Node] | None = None
) -> Counter:
    """Write ``node.meta["recompute"]`` on forward ops; getitems share their parent's tag.

    ``recomputable`` limits PREFER_RECOMPUTE to those nodes (the "auto" budget); the others keep the
    min-cut partitioner's own rules. Block inputs (``boundaries``, default ``layer_boundaries``) are saved.
    """
    counts: Counter = Counter()
    boundaries = layer_boundaries(joint) if boundaries is None else boundaries
    for node in forward_nodes(joint):
        if node.op != "call_function":
            continue
        if node in boundaries:
            policy = CheckpointPolicy.MUST_SAVE
        elif node.target is operator.getitem and node.args[0].meta.get("recompute") is not None:
            policy = node.args[0].meta["recompute"]
        else:
            policy = recompute_policy(node)
            if (
                policy is CheckpointPolicy.PREFER_RECOMPUTE
                and recomputable is not None
                and node not in recomputable
            ):
                continue
        node.meta["recompute"] = policy
        node.meta.setdefault("ac_graph_id", 0)
        counts[policy.name] += 1
    return counts


def node_flops(node: fx.Node) -> int:
    """FLOPs of one ATen node from its fake values (matmuls, attention); other ops count 0."""
    packet = getattr(node.target, "_overloadpacket", None)
    if _op_name(node) in _SEQUENCE_FIRST_ATTENTION_OPS:
        query, key = value_of(node.args[0]), value_of(node.args[1])
        return symbols.concrete(4 * math.prod(query.shape[:-1]) * key.shape[-3] * query.shape[-1])
    if _op_name(node) in _ATTENTION_OPS:
        query, key = value_of(node.args[0]), value_of(node.args[1])
        batch_heads = math.prod(query.shape[:-2])
        return symbols.concrete(4 * batch_heads * query.shape[-2] * key.shape[-2] * query.shape[-1])
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args = torch.fx.node.map_arg(node.args, value_of)
    kwargs = torch.fx.node.map_arg(node.kwargs, value_of)
    try:
        return symbols.concrete(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # an unusual overload: count nothing rather than fail the compile
        return 0


def choose_recomputable(joint: fx.GraphModule, overhead: float) -> tuple[set[fx.Node], str]:
    """Pick the ops whose recompute buys the most memory per FLOP, within ``overhead`` of the step.

    The step costs about 3x the forward FLOPs (forward + 2x backward). Ops are taken cheapest
    FLOPs-per-byte first: elementwise ops and norms (no matmul FLOPs) always, matmuls while their
    FLOPs fit in the budget. At long sequences attention dominates the FLOPs, so the budget covers
    the linear layers; at short ones it does not, and they stay saved.
    """
    forward = [n for n in forward_nodes(joint) if n.op == "call_function"]
    total = sum(node_flops(n) for n in forward)
    attention = sum(node_flops(n) for n in forward if _op_name(n) in _ATTENTION_OPS)
    budget = overhead * 3 * total
    candidates = [n for n in forward if recompute_policy(n) is CheckpointPolicy.PREFER_RECOMPUTE]
    candidates.sort(key=lambda n: node_flops(n) / max(node_bytes(n), 1))
    chosen, spent = set(), 0
    for node in candidates:
        flops = node_flops(node)
        if spent + flops > budget:
            break
        chosen.add(node)
        spent += flops
    share = attention / total if total else 0.0
    reason = (
        f"attention is {share:.0%} of forward FLOPs; recompute budget {overhead:.0%} of the step "
        f"({budget / 1e9:.3g} GFLOP) covers {len(chosen)}/{len(candidates)} ops ({spent / 1e9:.3g} GFLOP)"
    )
    return chosen, reason


@dataclass
class SACReport:
    """What SAC chose for one graph."""

    mode: str
    saved_bytes: int
    recomputed_ops: int
    recomputed_flops: int
    step_flops: int
    backward_collectives: int
    reason: str = ""
    parameter_gathers: int = 0  # all-gathers of sharded parameters backward runs again (data_parallel="fsdp")
    gathers_in_compute_dtype: int = 0  # parameters cast to autocast's dtype before their all-gather
    tiled_regions: int = 0  # row-wise regions run over tiles of rows (Note [Row tiling]), both graphs
    tiles: int = 0  # the most tiles one of them runs in
    # attention backwards given their output's row sums, not the output (row_sums.py)
    attention_outputs_by_row_sums: int = 0
    # layers that rebuild attention and its collectives in backward (memory_policy.py)
    attention_recompute: AttentionRecompute | None = None
    # saved values kept in host memory until backward (offload.py)
    offloaded: offload.Offload | None = None

    def line(self) -> str:
        share = self.recomputed_flops / self.step_flops if self.step_flops else 0.0
        text = (
            f"SAC ({self.mode}): {self.saved_bytes / 2**20:.2f} MiB of activations saved for backward, "
            f"{self.recomputed_ops} ops recomputed ({share:.1%} of step FLOPs)"
        )
        if self.offloaded is not None:
            text += f" ({self.offloaded.line()})"
        if self.parameter_gathers:
            text += f", {self.parameter_gathers} sharded parameters gathered again in backward"
        if self.gathers_in_compute_dtype:
            text += f" ({self.gathers_in_compute_dtype} gathered in the compute dtype)"
        if self.tiled_regions:
            text += f", {self.tiled_regions} row-wise regions run in up to {self.tiles} tiles of tokens"
        if self.attention_outputs_by_row_sums:
            text += f", {self.attention_outputs_by_row_sums} attention outputs replaced by their row sums"
        if self.attention_recompute is not None:
            text += f"; {self.attention_recompute.line()}"
        return f"{text}; {self.reason}" if self.reason else text


def summarize_partition(
    mode: str, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, reason: str = ""
) -> SACReport:
    """Bytes the forward hands to backward, and the forward ops backward runs again."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    # Inputs handed on (parameters, the batch) are held anyway; count the activations.
    saved = dict.fromkeys(
        v for v in output.args[0][num_fwd_outputs:] if isinstance(v, fx.Node) and v.op != "placeholder"
    )
    saved_bytes = sum(node_bytes(n) for n in saved)
    recomputed = [n for n in forward_nodes(backward) if n.op == "call_function" and node_flops(n) >= 0]
    recomputed = [n for n in recomputed if n.target is not operator.getitem and not offload.is_copy(n)]
    forward_flops = sum(node_flops(n) for n in forward.graph.nodes if n.op == "call_function")
    recomputed_flops = sum(node_flops(n) for n in recomputed)
    collectives = sum(
        1 for n in backward.graph.nodes if n.op == "call_function" and is_collective(n, waits=False)
    )
    gathers = sum(1 for n in backward.graph.nodes if n.op == "call_function" and is_parameter_all_gather(n))
    return SACReport(
        mode, saved_bytes, len(recomputed), recomputed_flops, 3 * forward_flops, collectives, reason, gathers
    )


class SequenceAwarePartitioner(CustomPartitionerFn):
    """Min-cut partitioning with SAC tags; a report per partitioned graph lands in ``reports``.

    Args:
        mode: "all" recomputes every op but attention, collectives and random ops; "auto" picks
            ops within ``overhead`` of the step's FLOPs (``choose_recomputable``); "longest" is "all"
            with every layer rebuilding its attention and collectives too (Note [Layers that recompute
            attention] in ``memory_policy.py``); "off" tags nothing (PyTorch's own min-cut choices)
            and only reports.
        activation_budget: with "all" or "auto", bytes the forward may hand to backward; layers
            rebuild attention and its collectives, most bytes per FLOP first, until SAC's saves fit.
        tile_bytes: with SAC on, a row-wise region of either graph (an MLP, its rebuild, its backward)
            whose widest inner value is at least this many bytes runs over tiles of tokens
            (Note [Row tiling] in ``tiling.py``); None never tiles.
        offload_activations: the values the forward saves for backward wait in host memory
            (Note [Activation offload] in ``offload.py``).
    """

    def __init__(
        self,
        mode: SACMode = "all",
        overhead: float = 0.1,
        tile_bytes: int | None = DEFAULT_TILE_BYTES,
        activation_budget: int | None = None,
        offload_activations: bool = False,
    ) -> None:
        self.mode = mode
        self.offload_activations = offload_activations
        self.activation_budget = activation_budget
        self.overhead = overhead
        self.tile_bytes = tile_bytes
        self.last_counts: Counter = Counter()
        self.reports: list[SACReport] = []

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        reason, by_row_sums, attention_recompute = "", 0, None
        if self.mode != "off":
            # Before tagging: what backward reads decides what the partitioner saves.
            by_row_sums = row_sums.hand_attention_output_by_row_sums(gm)
            recomputable, reason = (
                choose_recomputable(gm, self.overhead) if self.mode == "auto" else (None, "")
            )
            boundaries = layer_boundaries(gm)
            self.last_counts = tag_recompute_policy(gm, recomputable, boundaries)
            if self.mode == "longest" or self.activation_budget is not None:
                attention_recompute = self._send_layers(gm, boundaries)
        cast_gathers = cast_before_parameter_gathers(gm)
        self.last_counts["GATHERED_PARAMETER"] = tag_parameter_gathers(gm)
        with contextlib.ExitStack() as stack:
            if self.offload_activations:
                offload.mark_offload_candidates(gm)
                stack.enter_context(offload.offloading(gm))
            forward, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        # What SAC chose, before tiling rewrites the recomputed ops into per-tile copies.
        report = summarize_partition(self.mode, forward, backward, kwargs["num_fwd_outputs"], reason)
        tilings = []
        if self.mode != "off" and self.tile_bytes is not None:
            tilings = [tile_rows_pass(g, min_bytes=self.tile_bytes) for g in (forward, backward)]
        for graph_module, is_backward in ((forward, False), (backward, True)):  # Note [Collective order]
            order_collectives(graph_module.graph, backward=is_backward)
            graph_module.recompile()
        if self.offload_activations:
            offload.wait_one_copy_later(forward)
        report.gathers_in_compute_dtype = cast_gathers
        report.attention_outputs_by_row_sums = by_row_sums
        report.attention_recompute = attention_recompute
        report.offloaded = offload.moved_to_host(forward) if self.offload_activations else None
        report.tiled_regions = sum(t.regions for t in tilings)
        report.tiles = max((t.tiles for t in tilings), default=0)
        self.reports.append(report)
        log.info(report.line())
        return forward, backward

    def _send_layers(self, joint: fx.GraphModule, boundaries: set[fx.Node]) -> AttentionRecompute:
        """Tag the layers that rebuild attention and its collectives (Note [Layers that recompute
        attention] in ``memory_policy.py``)."""
        forward = forward_nodes(joint)
        is_attention = lambda node: _op_name(node) in _ATTENTION_OPS
        layers = layer_saves(forward, boundaries, is_attention, node_flops)
        budget = None if self.mode == "longest" else self.activation_budget
        choice = choose_layers(layers, kept_bytes(forward), budget)
        send_layers(layers, choice, values_shared_by_layers(forward, boundaries, is_attention))
        return choice

    def uuid(self) -> Any:
        # Inductor's FX graph and AOTAutograd caches key on this, so it must change with everything
        # that changes the partition: the code of the passes it runs and every setting.
        files = (
            __file__,
            tiling.__file__,
            row_sums.__file__,
            memory_policy.__file__,
            parameter_gathers.__file__,
            ordering.__file__,
            offload.__file__,
        )
        extra = (
            f"mode={self.mode!r} overhead={self.overhead!r} tile={self.tile_bytes} "
            f"budget={self.activation_budget} offload={self.offload_activations}"
        )
        return get_hash_for_files(files, extra=extra)
