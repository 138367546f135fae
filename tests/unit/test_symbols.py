"""Sizes in the sequence symbols (``compiler/symbols.py``, Note [One graph for every length]): a global
length written as an expression of a rank's shard symbol becomes graph nodes, so one compiled graph
computes it for every length."""

from __future__ import annotations

import pytest
import sympy
import torch

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import meta_value, with_sizes

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize(("rank", "remainder"), [(0, 1), (1, 1), (0, 0)])
def test_the_global_length_is_affine_in_the_shard_symbol(rank: int, remainder: int) -> None:
    s = sympy.Symbol("s", integer=True, positive=True)
    for total in range(remainder + 2, 40, 2):  # every length of the class: G % 2 == remainder
        local = total // 2 + int(rank < remainder)
        assert symbols.symbolic_global(s, 2, rank, remainder).subs(s, local) == total


def test_a_size_in_the_shard_symbol_is_computed_by_the_graph_at_every_length() -> None:
    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(gm)
        shape_env = symbols.graph_shape_env(gm, example_inputs)
        local = next(meta_value(n) for n in gm.graph.nodes if isinstance(meta_value(n), torch.SymInt))
        symbol = symbols.raw_expr(local)
        # rank 0 of 2 in the odd class: G = 2 * (s - 1) + 1, positions of the whole sequence
        total = symbols.symint(shape_env, symbols.symbolic_global(symbol, 2, 0, 1), {symbol: local.node.hint})
        arange = next(n for n in gm.graph.nodes if n.target is torch.arange)
        arange.args = with_sizes(gm.graph, (total,))  # arange(s) -> arange(G): the whole sequence
        gm.recompile()
        return gm

    step = torch.compile(lambda x: torch.arange(x.size(1)), backend=backend, dynamic=False)
    for local in (5, 8, 13):
        x = torch.randn(2, local)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        assert step(x).tolist() == list(range(2 * local - 1))
    assert len(compiles) == 1
    emitted = [n for n in compiles[0].graph.nodes if "autosp_size" in n.meta]
    assert emitted and all(n.op == "call_function" for n in emitted)


def test_an_estimate_reads_a_symbol_without_fixing_it() -> None:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        shape_env = symbols.graph_shape_env(gm, example_inputs)
        tokens = next(n for n in gm.graph.nodes if isinstance(meta_value(n), torch.Tensor))
        size = meta_value(tokens).shape[1]
        assert symbols.concrete(3 * size) == 3 * size.node.hint
        assert not symbols.pinned_symbols(shape_env, [symbols.raw_expr(size)])
        return gm

    x = torch.randn(2, 7)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    torch.compile(lambda x: x + 1, backend=backend, dynamic=False)(x)
