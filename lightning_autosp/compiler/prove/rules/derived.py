"""Rules derived from torch's own op metadata, for ops the table does not name.

Note [Rules derived from torch]
    The table in ``rules/__init__.py`` names the ops whose treatment of the sequence someone wrote down.
    A user's step calls many more spellings of the same arithmetic (``F.logsigmoid`` is recorded as
    ``torch._C._nn.log_sigmoid``; ``torch.special`` aliases; new activations). An op no entry names is
    not refused outright: the analysis decomposes one call of it, on stand-in tensors of its
    arguments' shapes and dtypes, into torch's core ATen ops (``make_fx`` with the core decomposition
    table). If every op of the decomposition carries ``torch.Tag.pointwise`` (constants and casts
    aside) and the output has the broadcast shape of the tensor inputs, the op acts on each element
    alone and takes the pointwise rule, as if the table named it. Anything else (a reduction, a view, a
    random op, a decomposition that fails) stays refused by name, so the derivation can only widen the
    proven set with ops torch itself calls pointwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import meta_value

# What a decomposition may hold besides pointwise ops: casts, and the constants it builds of a scalar.
_CASTS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.scalar_tensor.default,
}


def callable_of(node: fx.Node) -> Callable | None:
    """What ``node`` calls, as a Python callable: the function itself, or the Tensor method."""
    if node.op == "call_function":
        return node.target if callable(node.target) else None
    if node.op == "call_method":
        return getattr(torch.Tensor, str(node.target), None)
    return None


def acts_on_each_element(node: fx.Node) -> bool:
    """Whether torch decomposes this call into pointwise ops only (Note [Rules derived from torch])."""
    function = callable_of(node)
    if function is None:
        return False
    args, kwargs = fx.node.map_aggregate((node.args, dict(node.kwargs)), _stand_in)
    tensors = _tensors([args, kwargs])
    if not tensors:
        return False
    try:
        with unset_fake_temporarily(), torch.no_grad():
            traced = make_fx(
                lambda: function(*args, **kwargs), decomposition_table=core_aten_decompositions()
            )()
            out = function(*args, **kwargs)
    except Exception:  # an op torch cannot decompose on stand-ins is left to the table: refused
        return False
    if not isinstance(out, torch.Tensor):
        return False
    try:
        broadcast = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return False
    return out.shape == broadcast and all(
        _elementwise(n) for n in traced.graph.nodes if n.op == "call_function"
    )


def _elementwise(node: fx.Node) -> bool:
    op = node.target
    tags = getattr(op, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    if op in _CASTS or torch.Tag.pointwise in tags:
        return True
    return op is torch.ops.aten.full.default and all(size == 1 for size in node.args[0])


def _stand_in(value: object) -> object:
    """A real tensor of a traced value's shape and dtype (sizes as traced), or the value itself."""
    if not isinstance(value, fx.Node):
        return value
    example = meta_value(value)
    if isinstance(example, torch.Tensor):
        return torch.ones([symbols.hint(size) for size in example.shape], dtype=example.dtype)
    hinted = symbols.hint(example)
    return hinted if hinted is not None else example


def _tensors(tree: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(tree, lambda x: found.append(x) if isinstance(x, torch.Tensor) else None)
    return found
