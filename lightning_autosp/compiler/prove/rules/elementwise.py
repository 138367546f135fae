"""Rules for ops that act on each element (with broadcasting): the layout propagates.

A sum over tokens (``PARTIAL``) survives the ops that are linear in it (adding another partial sum,
scaling by a replicated value, a cast); any other op needs the whole value first, so the analysis
plans an all-reduce of it (Note [Sequence layouts]).
"""

from __future__ import annotations

import torch
from torch import fx

from lightning_autosp.compiler.fx_utils import meta_value, op_name
from lightning_autosp.compiler.prove.layout import CAUSAL, PARTIAL, REPLICATE, Layout, global_, shard
from lightning_autosp.compiler.prove.plan import Decided, decide, layout_of
from lightning_autosp.compiler.prove.rules import dispatch
from lightning_autosp.compiler.prove.rules.common import ndim, tensor_nodes
from lightning_autosp.compiler.prove.rules.split import broadcast, handles_split, home_or_align, sizes


def _names(text: str) -> set[str]:
    return set(text.split())


# Ops applied to each element of their tensor inputs, with broadcasting.
POINTWISE = _names(
    "abs absolute acos acosh add addcdiv addcmul and_ angle asin asinh atan atan2 atanh bitwise_and "
    "bitwise_left_shift bitwise_not bitwise_or bitwise_right_shift bitwise_xor ceil celu clamp clamp_max "
    "clamp_min clip copysign cos cosh deg2rad div divide elu eq erf erfc erfinv exp exp2 expm1 fix "
    "float_power floor floor_divide floordiv fmax fmin fmod frac ge gelu glu gt hardshrink hardsigmoid "
    "hardswish hardtanh heaviside hypot i0 invert isfinite isinf isnan isneginf isposinf le leaky_relu "
    "lerp lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor "
    "logit logsigmoid lt masked_fill maximum minimum mish mod mul multiply nan_to_num ne neg negative "
    "nextafter not_equal or_ pos positive pow prelu rad2deg reciprocal relu relu6 remainder round rrelu "
    "rsqrt rsub selu sgn sigmoid sign signbit silu sin sinc sinh softplus softshrink sqrt square sub "
    "subtract tan tanh tanhshrink threshold true_divide truediv trunc where xlogy xor dropout "
    "alpha_dropout feature_alpha_dropout native_dropout"
) | _names(  # casts and copies
    "to type type_as float double half bfloat16 int long short bool byte char cpu cuda contiguous clone "
    "detach requires_grad_ real imag conj resolve_conj resolve_neg polar complex"
)

# In-place forms: the result is the first argument, which must keep its layout.
IN_PLACE = {f"{name}_" for name in POINTWISE} | _names(
    "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift fill_ zero_ copy_"
)
# Ops linear in one partial sum: sum_r f(x_r) = f(sum_r x_r) for replicated other operands.
_LINEAR_IN_ONE = {"mul", "multiply", "imul", "div", "divide", "truediv", "true_divide", "itruediv"}
_LINEAR_IN_ALL = {"add", "sub", "subtract", "iadd", "isub", "neg", "negative", "pos", "positive"}
_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "detach"}


@dispatch.handles_local_order
@handles_split
def pointwise(a, node: fx.Node) -> Decided:
    tensors = tensor_nodes([*node.args, *node.kwargs.values()])
    out_rank = ndim(node)
    regrouped = home_or_align(a, [broadcast(t, out_rank) for t in tensors], out_rank)
    if regrouped is not None:
        return regrouped
    layouts = [a.layout(t) for t in tensors]
    permuted = dispatch.elementwise(a, node, layouts)
    if permuted is not None:
        return permuted
    if PARTIAL in layouts:
        if _linear_in_partial(node, tensors, layouts):
            return PARTIAL
        for tensor in tensors:
            a.materialize(tensor)
        layouts = [REPLICATE if layout == PARTIAL else layout for layout in layouts]
    if CAUSAL in layouts:
        if any(layout not in (CAUSAL, REPLICATE) for layout in layouts):
            return a.refuse(
                node,
                "combines a causal mask handed on from the previous graph with other sequence data",
                "Build the combined mask in the graph where attention uses it (avoid a graph break "
                "between them)",
            )
        return CAUSAL
    local, whole, flat, inner = set(), set(), set(), {}
    for tensor, layout in zip(tensors, layouts):
        offset = out_rank - ndim(tensor)
        dims = {d + offset for d in layout.dims}
        (local if layout.kind == "shard" else whole).update(dims)
        flat.update(d + offset for d in layout.flat)
        for d, each in layout.flat_inner:
            if inner.setdefault(d + offset, each) != each:  # Note [Views of flattened tokens]
                return a.refuse(
                    node,
                    "combines values whose tokens were flattened with different dims (element i of one "
                    "is not element i of the other on a rank's part)",
                    "Flatten both values from the same dim order before combining them",
                )
    for tensor, layout in zip(tensors, layouts):  # a replicated operand broadcasts along the tokens
        offset, size = out_rank - ndim(tensor), sizes(tensor)
        if layout == REPLICATE and any(size[d - offset] != 1 for d in local | whole if d >= offset):
            return a.refuse(
                node,
                f"combines {tensor.name}, a value the same on every rank with a dim as long as the tokens "
                "(a value gathered whole), with sequence data",
                "Keep the sequence dim of both values recognizable (one dim of the sequence's length)",
            )
    if local & whole:
        return a.refuse(
            node,
            "combines a value indexed by all tokens (a mask rebuilt for the whole sequence) with "
            "this rank's tokens",
            "Use the mask only as attention's attn_mask",
        )
    if whole:
        return decide(global_(*whole), "global_shapes")
    return shard(*local, flat=tuple(flat & local), flat_inner=tuple(inner.items()))


@dispatch.handles_local_order
def in_place(a, node: fx.Node) -> Decided:
    decided = pointwise(a, node)
    result = layout_of(decided)
    target = node.args[0] if node.args else None
    if isinstance(target, fx.Node) and a.moved(target):
        return a.refuse(
            node,
            f"updates {target.name} in place, which must first move to another layout ({a.layout(target)})",
            "Assign the result to a new tensor instead of updating one in place",
        )
    if isinstance(target, fx.Node) and result != a.layout(target) and a.layout(target) != PARTIAL:
        return a.refuse(
            node,
            f"writes a value of layout {result} in place into {target.name} ({a.layout(target)})",
            "Assign the result to a new tensor instead of updating one in place",
        )
    return decided


def _linear_in_partial(node: fx.Node, tensors: list[fx.Node], layouts: list[Layout]) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    scalars = [v for v in [*node.args, *node.kwargs.values()] if not isinstance(v, fx.Node)]
    partial = [t for t, layout in zip(tensors, layouts) if layout == PARTIAL]
    if name in _CASTS or (name in ("neg", "negative", "pos", "positive")):
        return True
    if name in _LINEAR_IN_ALL:
        # Every tensor operand a partial sum; a scalar added on each rank would be added P times.
        return len(partial) == len(tensors) and not any(isinstance(v, (int, float)) and v for v in scalars)
    if name in _LINEAR_IN_ONE:
        if len(partial) != 1 or any(layout not in (PARTIAL, REPLICATE) for layout in layouts):
            return False
        return name in ("mul", "multiply", "imul") or node.args[0] is partial[0]
    return False


def dropout_over_channels(a, node: fx.Node) -> Layout:
    """dropout1d/2d/3d drop whole channels across the spatial dims: across the sequence, one mask."""
    layout = a.layout(node.args[0])
    if layout.is_shard and any(d >= 2 for d in layout.dims):
        return a.refuse(
            node,
            "drops channels with one random mask across the sequence, which each rank would draw for "
            "its tokens",
            "Use F.dropout, or put the sequence in the channel dim",
        )
    return layout


def elementwise_function(a, node: fx.Node) -> object:
    """A custom ``autograd.Function`` (``autograd_function_apply(fwd_body, bwd_body, *args)``) whose forward
    and backward are both elementwise (Bloom's tanh GeLU): its output has its inputs' layout."""
    fwd, bwd, *operands = node.args
    bodies = [getattr(node.graph.owning_module, body.target) for body in (fwd, bwd)]
    ops = [n for body in bodies for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    if not all(op_name(n) in POINTWISE or n.target is torch._C._set_grad_enabled for n in ops):
        unknown = sorted({op_name(n) for n in ops if op_name(n) not in POINTWISE} - {"_set_grad_enabled"})
        return a.refuse(
            node,
            f"runs sequence data through a custom autograd.Function whose forward or backward is not "
            f"elementwise (it calls {', '.join(unknown)})",
            "Write the Function's math inline (its backward then comes from autograd)",
        )
    layouts = {a.layout(op) for op in tensor_nodes(operands)} - {REPLICATE}
    if len(layouts) > 1:
        return a.refuse(
            node,
            f"combines values of layouts {sorted(map(str, layouts))} elementwise",
            "Apply the Function to values of one layout",
        )
    layout = next(iter(layouts), REPLICATE)
    value = meta_value(node)
    return tuple(layout for _ in value) if isinstance(value, (tuple, list)) else layout


@dispatch.handles_local_order
@handles_split
def complex_view(a, node: fx.Node) -> Layout:
    """view_as_complex / view_as_real: pairs of the last dim as complex numbers, or back; the other dims,
    the sequence among them, stay where they are."""
    layout = a.layout(node.args[0])
    if ndim(node.args[0]) - 1 in (*layout.dims, layout.split):
        return a.refuse(node, "pairs values along the sequence as complex numbers", "Pair along the head dim")
    return layout


def outer(a, node: fx.Node) -> Layout:
    """``outer(u, v)`` is ``u[:, None] * v[None, :]``: a vector of positions (rotary angles computed in the
    step, ``outer(arange(T), inv_freq)``) keeps its tokens along dim 0, or along dim 1 when second."""
    first, second = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["vec2"]
    for vector in (first, second):
        a.materialize(vector)
    layouts = [REPLICATE if a.layout(v) == PARTIAL else a.layout(v) for v in (first, second)]
    if layouts[1] == REPLICATE and layouts[0].is_shard:
        return layouts[0]
    if layouts[0] == REPLICATE and layouts[1].is_shard:
        return shard(1, flat=(1,) if layouts[1].flat else ())
    return a.refuse(
        node,
        f"multiplies two vectors of layouts {layouts[0]} and {layouts[1]} into a matrix",
        "Keep one of the two vectors replicated (positions times frequencies)",
    )
