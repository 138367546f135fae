"""Parameters sharded by ``data_parallel="fsdp"``, all-gathered inside the compiled step.

Under ``data_parallel="fsdp"`` with ``fsdp_gather="per_use"`` a parameter enters the graph as its rank's
shard and is all-gathered where it is used (``lightning_autosp/fsdp.py``). The partitioner
(``compiler/partition/sac.py``) calls these two passes on the joint graph: one moves autocast's cast in
front of the gather, the other makes backward gather each parameter again instead of keeping it whole.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from lightning_autosp.compiler.fx_utils import forward_nodes, op_name, value_of
from lightning_autosp.compiler.runtime.ops import is_collective


def is_parameter_all_gather(node: fx.Node) -> bool:
    return op_name(node) == "all_gather_into_tensor" and is_collective(node)


_NO_INPUT = object()
_SHAPE_OPS = {"view", "_unsafe_view", "reshape", "alias", "slice", "narrow"}


def cast_before_parameter_gathers(joint: fx.GraphModule) -> int:
    """Move autocast's cast of a gathered parameter in front of its all-gather; return how many moved.

    ::

        weight_shard fp32 [out/W, in] -> all_gather -> wait -> view -> _to_copy(bf16) -> mm
        weight_shard fp32 [out/W, in] -> _to_copy(bf16) -> all_gather -> wait -> view -> mm

    Exact (an all-gather only moves elements) and half the bytes on the wire and in the gathered copy,
    in forward and in backward's re-gather. Only where every use of the gathered parameter is the same
    cast to a narrower dtype (matmul weights under autocast); a norm's weight, used in fp32, stays.
    Gradients are untouched: their reduce-scatter is built from backward nodes, in the parameter's dtype.
    """
    moved = 0
    for gather in [n for n in joint.graph.nodes if is_parameter_all_gather(n)]:
        chain, end = [gather], gather
        while len(end.users) == 1:
            (user,) = end.users
            reshapes = op_name(user) == "wait_tensor" or op_name(user) in _SHAPE_OPS
            if not reshapes or user.args[0] is not end:
                break
            chain.append(user)
            end = user
        casts = list(end.users)
        dtypes = {_cast_dtype(c) for c in casts}
        source = value_of(gather.args[0])
        if op_name(chain[-1]) == "all_gather_into_tensor" or len(dtypes) != 1 or None in dtypes:
            continue
        (dtype,) = dtypes
        if not isinstance(source, torch.Tensor) or dtype.itemsize >= source.dtype.itemsize:
            continue
        shard = gather.args[0]
        with joint.graph.inserting_before(gather):
            # prims' cast, not aten._to_copy: Inductor has decomposed the joint graph already
            cast_op = torch.ops.prims.convert_element_type.default
            early_cast = joint.graph.call_function(cast_op, (shard, dtype))
        gather.replace_input_with(shard, early_cast)
        for node in [early_cast, *chain]:
            _set_dtype(node, dtype, like=shard if node is early_cast else node)
        for cast in casts:
            cast.replace_all_uses_with(end)
            joint.graph.erase_node(cast)
        moved += 1
    if moved:
        joint.recompile()
    return moved


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a pure dtype cast converts to, else None."""
    if op_name(node) == "_to_copy" and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        return node.kwargs["dtype"]
    if op_name(node) == "convert_element_type":
        return node.args[1]
    return None


def _set_dtype(node: fx.Node, dtype: torch.dtype, like: fx.Node) -> None:
    value = like.meta["val"]
    with torch._guards.detect_fake_mode([value]) or contextlib.nullcontext():
        node.meta["val"] = value.to(dtype)
    node.meta.pop("tensor_meta", None)


def tag_parameter_gathers(joint: fx.GraphModule) -> int:
    """Tag ``MUST_RECOMPUTE`` on the forward ops that rebuild a whole parameter from its shard.

    Note [Gathered parameters in backward]
        Under ``data_parallel="fsdp"`` a parameter is its rank's shard, a graph input, all-gathered
        where it is used (``lightning_autosp/fsdp.py``)::

            weight_shard [out/W, in] -> (cast) -> all_gather -> wait -> (narrow padding) -> weight [out, in]

        Saving ``weight`` for backward would keep every parameter whole from its use in forward to
        backward: the whole model at the step's peak, which is what sharding is for. Recomputing the
        chain re-gathers each parameter in backward right before its gradient needs it, as FSDP's
        reshard-after-forward does. This is the one collective re-run in backward; SP's all-to-alls
        move activations, which would cost a second round of traffic of the sequence's size.

    A node is in such a chain when its only graph input is one primal and an all-gather is among its
    ancestors, is itself one, or is fed by it (a cast in front of the gather). Returns the number of
    nodes tagged; SAC's mode does not matter.
    """
    # The one primal each node is computed from; None when several (or a tangent), _NO_INPUT for
    # nodes computed from no input (constants, the padding of an uneven shard).
    source: dict[fx.Node, object] = {
        n: n for n in joint.graph.nodes if n.op == "placeholder" and "tangents" not in n.name
    }
    gathered: set[fx.Node] = set()
    for node in forward_nodes(joint):
        sources = {source.get(n) for n in node.all_input_nodes} - {_NO_INPUT}
        source[node] = sources.pop() if len(sources) == 1 else (_NO_INPUT if not sources else None)
        if not isinstance(source[node], fx.Node) or node.op != "call_function":
            continue
        if is_parameter_all_gather(node) or any(n in gathered for n in node.all_input_nodes):
            gathered.add(node)
    feeding = [n for n in gathered if is_parameter_all_gather(n)]
    while feeding:  # what is computed from the shard before the gather (a cast, padding)
        node = feeding.pop()
        for input_node in node.all_input_nodes:
            from_shard = input_node.op == "call_function" and isinstance(source.get(input_node), fx.Node)
            if from_shard and input_node not in gathered:
                gathered.add(input_node)
                feeding.append(input_node)
    for node in gathered:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta.setdefault("ac_graph_id", 0)
    return len(gathered)
