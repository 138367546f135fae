"""Saved activations in host memory between forward and backward (``offload_activations=True``).

Note [Activation offload]
    The partitioner decides which values the forward hands to backward (SAC's saves, each layer's input
    under ``sac="longest"``, a budget's mix). With offload on, those values leave the accelerator until
    backward reads them: each is copied to host memory after its last use in the forward and copied back
    in backward. That is the last of ALST's levers over checkpoints: with "longest" only the layer inputs
    are saved, and now they live on the host, so the device holds one layer's rebuild at a time.

    The copies are torch's own activation offloading (``torch._functorch._activation_offloading``), switched
    on through ``torch._functorch.config`` for the one partition we run: we mark the candidates
    (``meta["should_offload"]``) and torch's pass rewrites both graphs. Torch offloads only what is safe to
    move: a saved value that is not a view, a getitem, a model output or non-contiguous. On an accelerator
    the copies are asynchronous on a side stream into pinned host buffers; the forward waits for each once
    the next has started (below), and backward starts each copy back early enough to hide it behind the
    compute before its first use (prefetch, priced at ``activation_offload_cpu_gpu_bw`` GB/s), so about one
    layer's values are on their way back while the layer above runs. On CPU both copies stay in host memory
    and run synchronously: the mechanism runs and is tested (values round-trip, gradients exact, the bytes
    moved are the planner's), and what it frees is measured on a GPU (``benchmarks/gpu_check.sh``).

    Note [Waiting for a copy to host]
        An asynchronous copy is followed by a wait, which frees the device's copy once the host has it.
        Torch's pass puts the wait right after the copy starts, so the compute stream stalls for every
        copy; its option to sink the waits moves them all to the end of the graph, which keeps every
        offloaded value on the device until the forward ends (fine when each layer is its own graph, not
        for our one graph per step). We move each wait to just after the next copy starts: a layer's
        input is copied while the next layer computes, and at most two layers' saved values are on the
        device in the forward.

    Collectives are never moved: their outputs are saved as the waits' results, which may be moved like
    any other value, but the collective itself is not re-run (Note [Layers that recompute attention]).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

from lightning_autosp.compiler.fx_utils import forward_nodes, value_of
from lightning_autosp.compiler.partition.tiling_rules import node_bytes
from lightning_autosp.compiler.runtime.ops import is_collective

# The ops torch's pass inserts for the copy to host: synchronous, then asynchronous (a custom op).
_TO_HOST = ("prims.device_put.default", "ao.offload.default")
_ASYNC, _WAIT = "ao.offload.default", "ao.wait_tensor.default"
_COPIES = (*_TO_HOST, "ao.reload.default", _WAIT)


@dataclass(frozen=True)
class Offload:
    """What one partition moved to host memory."""

    values: int
    bytes: int

    def line(self) -> str:
        values = f"{self.values} value" + ("" if self.values == 1 else "s")
        return f"{self.bytes / 2**20:.2f} MiB of them ({values}) kept in host memory until backward"


def mark_offload_candidates(joint: fx.GraphModule) -> int:
    """Mark every forward value the partitioner may save as one to move to host memory; how many."""
    marked = 0
    for node in forward_nodes(joint):
        if node.op != "call_function" or is_collective(node, waits=False):
            continue
        if isinstance(value_of(node), torch.Tensor):
            node.meta["should_offload"] = True
            marked += 1
    return marked


def _accelerator_of(joint: fx.GraphModule) -> torch.device | None:
    for node in joint.graph.nodes:
        value = value_of(node)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device
    return None


@contextlib.contextmanager
def offloading(joint: fx.GraphModule) -> Iterator[None]:
    """Torch's activation offloading on for the partition of ``joint`` (Note [Activation offload])."""
    on_accelerator = _accelerator_of(joint) is not None
    if not on_accelerator:
        warnings.warn(
            "offload_activations=True on CPU copies the saved values within host memory, which frees nothing "
            "(the mechanism runs, for tests); its memory is an accelerator's",
            stacklevel=2,
        )
    with torch._functorch.config.patch(
        enable_activation_offloading=True,
        activation_offload_separate_stream=on_accelerator,
        activation_offload_sink_wait=False,  # Note [Waiting for a copy to host]
        activation_reload_prefetch=on_accelerator,
    ):
        yield


def wait_one_copy_later(forward: fx.GraphModule) -> int:
    """Move each wait for a copy to host to just after the next copy starts (Note [Waiting for a copy to
    host]); how many waits moved."""
    copies = [
        node for node in forward.graph.nodes if node.op == "call_function" and str(node.target) == _ASYNC
    ]
    moved = 0
    for copy, next_copy in zip(copies, copies[1:]):
        waits = [user for user in copy.users if str(user.target) == _WAIT]
        for wait in waits:
            next_copy.append(wait)
            moved += 1
    if moved:
        forward.graph.lint()
        forward.recompile()
    return moved


def is_copy(node: fx.Node) -> bool:
    """Whether ``node`` is one of the offload pass's copies (or waits for one): no compute."""
    return node.op == "call_function" and str(node.target) in _COPIES


def moved_to_host(forward: fx.GraphModule) -> Offload:
    """The values a partitioned forward copies to host memory, and their bytes."""
    copies = [
        node
        for node in forward.graph.nodes
        if node.op == "call_function"
        and str(node.target) in _TO_HOST
        and isinstance(value_of(node), torch.Tensor)
        and value_of(node).device.type == "cpu"
        and isinstance(node.args[0], fx.Node)
    ]
    return Offload(len(copies), sum(node_bytes(node.args[0]) for node in copies))
