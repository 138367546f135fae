"""Sequence-aware activation checkpointing (SAC) as an AOTAutograd partitioner.

At long sequence lengths attention dominates the FLOPs (attention / linear = S / 6h for a GPT
block), so recomputing linear, MLP, norm and elementwise ops in backward is cheap, while their
activations are most of the memory. PyTorch's min-cut partitioner refuses to recompute matmuls on
its own; tagging them ``PREFER_RECOMPUTE`` lifts that ban for this graph only. Attention outputs
and collectives are tagged ``MUST_SAVE``: attention is the expensive op, and a recomputed
collective would talk to other ranks again in backward.

Used through ``torch._inductor.config.custom_partitioner_fn`` (patched for one compile via
``compile_fx(config_patches=...)``) or as AOTAutograd's ``partition_fn``: no process-wide state.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
}


def _op_name(node: fx.Node) -> str:
    overload = getattr(node.target, "_overloadpacket", None)
    return getattr(overload, "__name__", "") if overload is not None else ""


def _is_collective(node: fx.Node) -> bool:
    namespace = getattr(getattr(node.target, "_overloadpacket", None), "_qualified_op_name", "")
    return namespace.startswith(("autosp::", "_c10d_functional::", "c10d_functional::"))


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """Nodes of a joint graph that do not depend on a tangent, i.e. the forward computation."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if "tangents" in node.name:
                backward.add(node)
            continue
        if node.op == "output":
            continue
        if any(n in backward for n in node.all_input_nodes):
            backward.add(node)
        else:
            forward.append(node)
    return forward


def recompute_policy(node: fx.Node) -> CheckpointPolicy:
    """Save attention, collectives and random ops; let everything else be recomputed."""
    if _op_name(node) in _ATTENTION_OPS or _is_collective(node) or _is_random(node):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def tag_recompute_policy(joint: fx.GraphModule) -> Counter:
    """Write ``node.meta["recompute"]`` on every forward op; getitems share their parent's tag."""
    counts: Counter = Counter()
    for node in forward_nodes(joint):
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0].meta.get("recompute") is not None:
            policy = node.args[0].meta["recompute"]
        else:
            policy = recompute_policy(node)
        node.meta["recompute"] = policy
        node.meta.setdefault("ac_graph_id", 0)
        counts[policy.name] += 1
    return counts


class SequenceAwarePartitioner(CustomPartitionerFn):
    """Min-cut partitioning with SAC tags. ``last_counts`` holds the policy counts of the last graph."""

    def __init__(self) -> None:
        self.last_counts: Counter = Counter()

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        self.last_counts = tag_recompute_policy(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
