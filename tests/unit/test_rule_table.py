"""The rule table cannot miss an elementwise op (issue 48): every elementwise op of torch's OpInfo database
(the ops torch's own tests sweep: unary and binary ufuncs, in each Python spelling they list) finds a rule,
by the function itself, by name, or derived from torch's decomposition of it (Note [Rules derived from torch]
in rules/derived.py), or is refused by name for a reason written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.rules import RULES_BY_OP, rule_for
from lightning_autosp.compiler.rules.elementwise import pointwise

pytest.importorskip("expecttest")  # torch's OpInfo database imports it

# Elementwise in torch's database, refused here, and why.
REFUSED_BY_NAME = {
    "frexp": "returns two tensors (mantissa, exponent): the pointwise rule follows one output",
    "gcd": "integer-only: the float stand-ins of its sample cannot be decomposed",
    "lcm": "integer-only: the float stand-ins of its sample cannot be decomposed",
    "nn.functional.rrelu": "random slopes, drawn per element: each rank would draw its own",
    "mvlgamma": "sums over its order p, not elementwise in torch's decomposition",
    "__rand__": "reflected operator: Dynamo records operator.and_ (ruled) instead",
    "__ror__": "reflected operator: Dynamo records operator.or_ (ruled) instead",
    "__rxor__": "reflected operator: Dynamo records operator.xor (ruled) instead",
    "isreal": "decomposes into a factory of the input's shape, not into pointwise ops",
    "fill": "writes one value into every element, replacing the tensor: a factory, not elementwise",
}


def call_node(function: object, sample: object) -> fx.Node:
    """A node calling ``function`` on ``sample``'s arguments, tensors as placeholders with values."""
    graph = fx.Graph()

    def placeholder(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        node = graph.placeholder(f"input_{len(graph.nodes)}")
        node.meta["example_value"] = value
        return node

    args = fx.node.map_aggregate((sample.input, *sample.args), placeholder)
    kwargs = fx.node.map_aggregate(dict(sample.kwargs), placeholder)
    return graph.call_function(function, tuple(args), dict(kwargs))


@pytest.mark.slow
def test_every_elementwise_op_of_torch_has_a_rule_or_a_reason() -> None:
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

    unruled, ruled = set(), 0
    for info in op_db:
        if not isinstance(info, (UnaryUfuncInfo, BinaryUfuncInfo)) or not hasattr(info.op, "__name__"):
            continue  # jiterator ops exist on CUDA only
        sample = next(iter(info.sample_inputs("cpu", torch.float32)), None)
        if sample is None:
            continue
        if rule_for(call_node(info.op, sample)) is None:
            unruled.add(info.name)
        else:
            ruled += 1
    assert unruled == set(REFUSED_BY_NAME), sorted(unruled ^ set(REFUSED_BY_NAME))
    assert ruled >= 180  # the database's size on torch 2.13: a sweep that found nothing would pass above


def test_a_function_finds_its_rule_under_any_spelling() -> None:
    """``F.logsigmoid`` is ``torch._C._nn.log_sigmoid``: the table names it once, and both find it."""
    assert RULES_BY_OP[F.logsigmoid] is pointwise
    assert RULES_BY_OP[torch._C._nn.log_sigmoid] is pointwise
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.ones(2, 3)
    assert rule_for(graph.call_function(torch._C._nn.log_sigmoid, (x,))) is pointwise


def test_an_op_no_entry_names_is_pointwise_only_if_torch_decomposes_it_so() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.ones(2, 3)
    assert torch.special.ndtr not in RULES_BY_OP
    assert rule_for(graph.call_function(torch.special.ndtr, (x,))) is pointwise  # erf-based, elementwise
    assert rule_for(graph.call_function(torch.special.logsumexp, (x, 1))) is not pointwise  # a reduction
    assert rule_for(graph.call_function(torch.Tensor.cummax, (x, 1))) is not pointwise  # a scan
