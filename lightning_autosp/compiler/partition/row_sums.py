"""Attention's backward without attention's output in the head layout: its row sums travel instead.

Note [Attention output by its row sums]
    A flash-attention backward (PyTorch's CPU kernel, FlashAttention-2 and the memory-efficient kernel on
    CUDA) reads its forward output O in one place: the row sums ``delta = rowsum(dO * O)`` of the softmax
    backward, ``dS = P * (dP - delta)``. Under SP that output exists twice, in the head layout
    [B, H/P, S, D] that attention produced and, after the all-to-all, in the sequence layout [B, H, S/P, D]
    that the output projection reads (its weight gradient needs it). Saving both for backward keeps the
    same values twice: with SAC on they are 2 of the 6 [S/P, h] tensors a GPT layer saves.

    Backward can compute delta where the sequence layout is: the gradient arriving for the all-to-all's
    received rows and the rows it received in forward have the same layout, so it sums their product over
    each head's D values there, and sends the sums to the head layout in the same all-to-all as the
    gradient (a few more columns per row: the float32 sums, as raw bytes of the gradient's dtype). The
    kernel then gets an O' with the same row sums instead of O::

        u = dO / max|dO|        (per row; |u| <= 1, the largest entry is +-1)
        O' = u * delta / (max|dO| * rowsum(u * u))     so that rowsum(dO * O') = delta

    (0 where dO's row is 0: delta is 0 there). The scaling keeps every value finite whatever dO's size;
    in float32 rowsum(dO * O') matches delta to a few ulps, all its terms having one sign; in bfloat16 O'
    is rounded once, as O itself was. Nothing in backward then reads O, so the partitioner does not save it.

    Exactness rests on the kernel reading O only through delta, which holds for the ops in
    ``_OUTPUT_ARGUMENT`` (and is checked against the kernel by ``tests/unit/test_row_sums.py``); any
    other attention keeps its output. The pattern is matched structurally: the backward's ``out`` is the
    forward's output, whose only user is a chain of views into an all-to-all, and its ``grad_out`` a
    chain of views out of that all-to-all's backward; the views keep each head's D values together as
    the innermost run of the rows (checked), so sums over D-runs of the rows are sums over D.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from lightning_autosp.compiler.fx_utils import Emitter, aten_fake_value, value_of

aten = torch.ops.aten
_functional = torch.ops._c10d_functional

# Attention backward ops that read their forward output only through rowsum(grad_out * out): the
# position of ``out`` among their arguments (``grad_out`` is the first).
_OUTPUT_ARGUMENT = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 4,
    aten._scaled_dot_product_flash_attention_backward.default: 4,
    aten._scaled_dot_product_efficient_attention_backward.default: 5,
}
_PASS_THROUGH = {aten.detach.default, aten.alias.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default}
_COPIES = {aten.clone.default}


def _keeps_runs(node: fx.Node, run: int) -> bool:
    """Whether a view or copy keeps every run of ``run`` consecutive values of its input's last dim
    (aligned to multiples of ``run``) as such a run of its output: a permute that keeps the last dim
    last, or a reshape to a last dim that is a multiple of ``run`` (a reshape keeps the order of
    elements, and the runs start at multiples of ``run`` in it)."""
    value, source = value_of(node), value_of(node.args[0])
    if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    if node.target is aten.permute.default:
        dims = [d % source.dim() for d in node.args[1]]
        return dims[-1] == source.dim() - 1
    if node.target in _COPIES:
        return True
    return _multiple(value.shape[-1], run)


def _multiple(size: object, run: int) -> bool:
    """Whether ``size`` (a number or a symbolic size) is a multiple of ``run`` for every length."""
    return bool(statically_known_true(sym_eq(size % run, 0)))


def _chain_down(start: fx.Node, run: int, reader: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """From ``start`` through single-user views to an all-to-all: (the views, the all-to-all). ``reader``
    (the attention backward) may read ``start`` too, directly or through a detach."""
    chain, node = [], start
    while True:
        users = [u for u in node.users if u.target not in _PASS_THROUGH and u is not reader]
        if len(users) != 1:
            return None
        (user,) = users
        if user.target is _functional.all_to_all_single.default and user.args[0] is node:
            return chain, user
        if user.target not in _VIEWS | _COPIES or user.args[0] is not node or not _keeps_runs(user, run):
            return None
        chain.append(user)
        node = user


def _chain_up(end: fx.Node, run: int) -> tuple[list[fx.Node], fx.Node] | None:
    """From ``end`` back through views to a ``wait_tensor``: (the views in order, the wait)."""
    chain, node = [], end
    while node.target in _VIEWS | _COPIES:
        if not _keeps_runs(node, run):
            return None
        chain.append(node)
        node = node.args[0]
    if node.target is not _functional.wait_tensor.default:
        return None
    return chain[::-1], node


def _strip(node: object) -> object:
    while isinstance(node, fx.Node) and node.target in _PASS_THROUGH:
        node = node.args[0]
    return node


class _Match:
    """One attention backward whose ``out`` can be replaced (Note [Attention output by its row sums])."""

    def __init__(self, backward: fx.Node) -> None:
        self.backward = backward
        self.out_index = _OUTPUT_ARGUMENT[backward.target]

    def find(self) -> bool:
        out = _strip(self.backward.args[self.out_index])
        if not isinstance(out, fx.Node) or out.target is not operator.getitem or out.args[1] != 0:
            return False
        value = value_of(out)
        if not isinstance(value, torch.Tensor) or not isinstance(value.shape[-1], int):
            return False
        self.out, self.head_dim = out, value.shape[-1]
        sent = _chain_down(out, self.head_dim, self.backward)
        grad = _chain_up(self.backward.args[0], self.head_dim)
        if sent is None or grad is None:
            return False
        (_, self.forward_a2a), (self.grad_views, self.grad_wait) = sent, grad
        self.backward_a2a = self.grad_wait.args[0]
        forward_waits = [u for u in self.forward_a2a.users if u.target is _functional.wait_tensor.default]
        if self.backward_a2a.target is not _functional.all_to_all_single.default or len(forward_waits) != 1:
            return False
        (self.received,) = forward_waits
        forward_args, backward_args = self.forward_a2a.args, self.backward_a2a.args
        # The gradient's all-to-all is the forward one reversed: the same group, the splits swapped.
        if backward_args[1:] != (forward_args[2], forward_args[1], forward_args[3]):
            return False
        received, grad_rows = value_of(self.received), value_of(self.backward_a2a.args[0])
        return (
            isinstance(received, torch.Tensor)
            and isinstance(grad_rows, torch.Tensor)
            and received.dim() == 3
            and all(statically_known_true(sym_eq(a, b)) for a, b in zip(received.shape, grad_rows.shape))
            and _multiple(received.shape[-1], self.head_dim)
        )


def _size(emit: Emitter, node: fx.Node, dim: int) -> object:
    size = value_of(node).shape[dim]
    return size if isinstance(size, int) else emit.call(aten.sym_size.int, (node, dim))


def _to_float(emit: Emitter, node: fx.Node) -> fx.Node:
    if value_of(node).dtype == torch.float32:
        return node
    return emit.call(torch.ops.prims.convert_element_type.default, (node, torch.float32))


def _rewrite(graph: fx.Graph, match: _Match) -> None:
    grad_rows = match.backward_a2a.args[0]
    dtype, run = value_of(grad_rows).dtype, match.head_dim
    emit = Emitter(graph, grad_rows)
    rows, heads, width = (_size(emit, grad_rows, d) for d in range(3))
    runs = emit.size(operator.floordiv, width, run)
    # delta over this rank's rows, float32 [rows, heads, runs], sent as raw bytes of the gradient's dtype
    product = emit.call(aten.mul.Tensor, (_to_float(emit, grad_rows), _to_float(emit, match.received)))
    split = emit.call(aten.view.default, (product, [rows, heads, runs, run]))
    delta = emit.call(aten.sum.dim_IntList, (split, [-1]))
    packed = emit.call(aten.cat.default, ([grad_rows, emit.call(aten.view.dtype, (delta, dtype))], -1))
    _, output_splits, input_splits, group = match.backward_a2a.args
    sent = emit.call(_functional.all_to_all_single.default, (packed, output_splits, input_splits, group))
    arrived = emit.call(_functional.wait_tensor.default, (sent,))
    grad = emit.call(aten.slice.Tensor, (arrived, -1, 0, width))
    packed_width = _size(emit, arrived, 2)
    delta_bytes = emit.call(aten.slice.Tensor, (arrived, -1, width, packed_width))
    delta_bytes = emit.call(aten.clone.default, (delta_bytes,), {"memory_format": torch.contiguous_format})
    delta = emit.call(aten.view.dtype, (delta_bytes, torch.float32))  # [tokens, heads, runs]
    # O' with delta's row sums (Note [Attention output by its row sums])
    tokens = _size(emit, arrived, 0)
    runs_of = emit.call(aten.view.default, (_to_float(emit, grad), [tokens, heads, runs, run]))
    largest = emit.call(aten.amax.default, (emit.call(aten.abs.default, (runs_of,)), [-1], True))
    nonzero = emit.call(aten.gt.Scalar, (largest, 0))
    scale = emit.call(aten.where.ScalarOther, (nonzero, largest, 1.0))
    unit = emit.call(aten.div.Tensor, (runs_of, scale))
    norm = emit.call(aten.sum.dim_IntList, (emit.call(aten.mul.Tensor, (unit, unit)), [-1], True))
    denominator = emit.call(aten.mul.Tensor, (scale, norm))
    weight = emit.call(aten.div.Tensor, (emit.call(aten.unsqueeze.default, (delta, -1)), denominator))
    weight = emit.call(aten.where.ScalarOther, (nonzero, weight, 0.0))
    stand_in = emit.call(aten.mul.Tensor, (unit, weight))
    stand_in = emit.call(torch.ops.prims.convert_element_type.default, (stand_in, value_of(match.out).dtype))
    stand_in = emit.call(aten.view.default, (stand_in, [tokens, heads, width]))
    # The gradient's views, as before, now from the packed rows; O' through the same views.
    match.grad_wait.replace_all_uses_with(grad)
    for view in match.grad_views:
        stand_in = emit.call(view.target, (stand_in, *view.args[1:]), dict(view.kwargs), like=view)
    for view in match.grad_views:  # their input is a slice of the packed rows now
        view.meta["val"] = aten_fake_value(view)
    match.backward.update_arg(match.out_index, stand_in)
    for node in (match.grad_wait, match.backward_a2a):
        if not node.users:
            graph.erase_node(node)


def hand_attention_output_by_row_sums(joint: fx.GraphModule) -> int:
    """Rewrite every attention backward that can read its output's row sums instead of the output
    (Note [Attention output by its row sums]); returns how many were rewritten."""
    rewritten = 0
    for node in list(joint.graph.nodes):
        if node.op != "call_function" or node.target not in _OUTPUT_ARGUMENT:
            continue
        match = _Match(node)
        if not match.find():
            continue
        _rewrite(joint.graph, match)
        rewritten += 1
    if rewritten:
        for node in reversed(list(joint.graph.nodes)):  # the detached copies of out nobody reads now
            if node.target in _PASS_THROUGH and not node.users:
                joint.graph.erase_node(node)
        joint.graph.lint()
        joint.recompile()
    return rewritten
