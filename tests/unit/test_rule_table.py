"""The rule table cannot miss an op (issue 48): every elementwise op of torch's OpInfo database (the ops
torch's own tests sweep: unary and binary ufuncs, in each Python spelling they list) finds a rule, by the
function itself, by name, or derived from torch's decomposition of it (Note [Rules derived from torch] in
rules/derived.py), or is refused by name for a reason written here; so does every reduction, shape function
and view of the database, as a function and as a method. The ops the sweeps found unruled and that now
have rules are checked against one device."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from benchmarks.common import grad_rel_err, rel_err
from lightning_autosp.compiler.prove.rules import RULES_BY_OP, rule_for
from lightning_autosp.compiler.prove.rules.elementwise import pointwise
from tests.distributed.modules import VOCAB
from tests.unit.sp_graphs import simulate_step, single_device

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


# Reductions, shape functions and views in torch's database, refused here, and why (name, spelling).
REFUSED_STRUCTURAL = {
    ("hash_tensor", "function"): "a hash of the values: not a sum, extremum or mean the shards can combine",
    ("hash_tensor", "method"): "a hash of the values: not a sum, extremum or mean the shards can combine",
    ("diagonal", "function"): "pairs two dims' positions: over the sequence, positions of other ranks",
    ("diagonal", "method"): "pairs two dims' positions: over the sequence, positions of other ranks",
    ("linalg.diagonal", "function"): "pairs two dims' positions: over the sequence, positions of other ranks",
    ("as_strided", "function"): "addresses memory by strides, not dims: no layout follows it",
    ("as_strided", "method"): "addresses memory by strides, not dims: no layout follows it",
    ("unfold", "method"): "sliding windows: over the sequence, a window crosses into the next rank's tokens",
}


def call_node(function: object, sample: object, method: bool = False) -> fx.Node:
    """A node calling ``function`` (a method's name with ``method``) on ``sample``'s arguments, tensors as
    placeholders with values."""
    graph = fx.Graph()

    def placeholder(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        node = graph.placeholder(f"input_{len(graph.nodes)}")
        node.meta["example_value"] = value
        return node

    args = fx.node.map_aggregate((sample.input, *sample.args), placeholder)
    kwargs = fx.node.map_aggregate(dict(sample.kwargs), placeholder)
    if method:
        return graph.call_method(function, tuple(args), dict(kwargs))
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


def _returns_a_view(info: object) -> bool:
    packet = getattr(torch.ops.aten, (info.aten_name or info.name).split(".")[0], None)
    schema = getattr(getattr(packet, "default", None), "_schema", None)
    returns = schema.returns if schema is not None else []
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


@pytest.mark.slow
def test_every_reduction_shape_function_and_view_of_torch_has_a_rule_or_a_reason() -> None:
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo.core import ReductionOpInfo, ShapeFuncInfo

    unruled, ruled = set(), 0
    for info in op_db:
        if not (isinstance(info, (ReductionOpInfo, ShapeFuncInfo)) or _returns_a_view(info)):
            continue
        sample = next(iter(info.sample_inputs("cpu", torch.float32)), None)
        if sample is None:
            continue
        spellings = []
        if getattr(info.op, "__name__", "<lambda>") != "<lambda>":  # the database's own lambdas: no spelling
            spellings.append((info.op, "function"))
        if info.method_variant is not None:
            spellings.append((info.method_variant.__name__, "method"))
        for target, spelling in spellings:
            if rule_for(call_node(target, sample, method=spelling == "method")) is None:
                unruled.add((info.name, spelling))
            else:
                ruled += 1
    assert unruled == set(REFUSED_STRUCTURAL), sorted(unruled ^ set(REFUSED_STRUCTURAL))
    assert ruled >= 85  # 88 on torch 2.13: a sweep that found nothing would pass above


class NewlyRuled(torch.nn.Module):
    """The ops the structural sweep and the fuzzer found unruled that have exact layouts:
    ``linalg.vector_norm`` over the sequence and over channels, ``tile`` on channels, and adaptive pools
    of the sequence to one output (the mean or maximum they compute; ``normalize.py``); and indexed
    assignments that leave the sequence whole (Qwen3.5's rotary sections: ``x[..., 1:8:3] = y[..., 1:8:3]``).
    """

    def __init__(self, idiom: str) -> None:
        super().__init__()
        self.idiom = idiom
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 3)
        self.lm_head = torch.nn.Linear(16, VOCAB)
        self.pool = torch.nn.AdaptiveMaxPool1d(1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        if self.idiom == "vector_norm_over_sequence":
            return F.cross_entropy(self.head(torch.linalg.vector_norm(x, dim=1)), batch["cls"])
        if self.idiom == "vector_norm_over_channels":
            x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            return F.cross_entropy(self.head(x.mean(1)), batch["cls"])
        if self.idiom == "adaptive_avg_pool":
            return F.cross_entropy(
                self.head(F.adaptive_avg_pool1d(x.transpose(1, 2), 1).squeeze(-1)), batch["cls"]
            )
        if self.idiom == "adaptive_max_pool_module":
            return F.cross_entropy(self.head(self.pool(x.transpose(1, 2)).squeeze(-1)), batch["cls"])
        if self.idiom == "adaptive_avg_pool2d":
            return F.cross_entropy(
                self.head(F.adaptive_avg_pool2d(x[:, None], (1, None)).flatten(1)), batch["cls"]
            )
        if self.idiom == "sections_assigned":
            sections = x.clone()
            sections[..., 1:8:3] = torch.sin(x)[..., 1:8:3]
            sections[..., 0] = 0.5
            sections[:, :, None, 2] = x[..., 4:5].exp()
            return F.cross_entropy(
                self.lm_head(torch.cat((sections, x), -1)).flatten(0, 1), batch["input_ids"].flatten()
            )
        tiled = x.tile(1, 1, 2) if self.idiom == "tile_method" else torch.tile(x, (2,))
        return F.cross_entropy(self.lm_head(tiled).flatten(0, 1), batch["input_ids"].flatten())


@pytest.mark.parametrize(
    "idiom",
    [
        "vector_norm_over_sequence",
        "vector_norm_over_channels",
        "tile_method",
        "tile_function",
        "adaptive_avg_pool",
        "adaptive_max_pool_module",
        "adaptive_avg_pool2d",
        "sections_assigned",
    ],
)
@pytest.mark.parametrize(("batch_size", "length", "world"), [(1, 23, 2), (2, 26, 4)])
def test_newly_ruled_ops_equal_one_device(idiom: str, batch_size: int, length: int, world: int) -> None:
    torch.manual_seed(0)
    module = NewlyRuled(idiom)
    generator = torch.Generator().manual_seed(length)
    batch = {
        "input_ids": torch.randint(0, VOCAB, (batch_size, length), generator=generator),
        "cls": torch.randint(0, 3, (batch_size,), generator=generator),
    }
    loss, grads = single_device(module, batch)
    simulated = simulate_step(module, batch, world)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4


class EmbeddedThen(torch.nn.Module):
    """Token embeddings, then ``then(embeddings)`` summed: one op over the sequence, for a refusal."""

    def __init__(self, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.then = then
        self.embed = torch.nn.Embedding(VOCAB, 8)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.then(self.embed(batch["input_ids"])).sum()


def _rows_assigned(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[:, 2:5] = 0.0  # positions 2 to 4 of the whole sequence: not this rank's rows 2 to 4
    return x


@pytest.mark.parametrize(
    ("then", "refusal"),
    [
        (lambda x: x.tile(1, 2, 1), "repeats values along the sequence"),
        (lambda x: F.adaptive_avg_pool1d(x.transpose(1, 2), 4), "adaptive_avg_pool1d"),
        (_rows_assigned, "assigns into a tensor by index"),
    ],
    ids=["tile_along_the_sequence", "adaptive_pool_to_four_outputs", "rows_of_the_sequence_assigned"],
)
def test_ops_without_an_exact_layout_over_the_sequence_are_refused(then, refusal: str) -> None:
    batch = {"input_ids": torch.randint(0, VOCAB, (1, 23))}
    with pytest.raises(NotImplementedError, match=refusal):
        simulate_step(EmbeddedThen(then), batch, 2)
