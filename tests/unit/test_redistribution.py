"""Ops that mix tokens outside SDPA, made exact by redistribution (Note [Redistribution]): each model equals
one device on every rank (ranks simulated in one process, ``tests/unit/sp_graphs.py``), and the moves that
make it so are the ones ``explain()`` lists. Models: ``tests/distributed/mixer_modules.py``; the same
families through Lightning on 2 processes, with HF models, are in the zoo (``tests/zoo``)."""

from __future__ import annotations

import operator

import pytest
import torch

from benchmarks.common import grad_rel_err, rel_err
from lightning_autosp.compiler.fx_utils import eliminate_dead_code
from tests.distributed import mixer_modules as mixers
from tests.distributed.modules import VOCAB
from tests.unit.sp_graphs import simulate_step, single_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LENGTH = 25  # odd: shards of 13 and 12
# model -> a fragment of explain() every run must show (the move or rewrite that makes it exact)
EXACT = {
    "multihead_attention": (mixers.MultiheadAttentionLM, "nn.MultiheadAttention calls as SDPA"),
    "transformer_encoder": (mixers.TransformerEncoderLM, "nn.MultiheadAttention calls as SDPA"),
    "alibi_per_head_mask": (mixers.AlibiGPT, "attention nodes: 2"),
    "hybrid_linear_attention": (mixers.HybridLM, "-> split(1, whole sequence in 2) for conv1d"),
    "written_attention": (mixers.WrittenAttentionGPT, "-> split(1, whole sequence in 2) for matmul"),
    "checkpointed_blocks": (mixers.CheckpointedGPT, "activation checkpointing was replaced by SAC"),
    "meta_llama_idioms": (mixers.MetaLlamaBlockLM, "attention nodes: 1"),
    "mean_pool_classifier": (lambda: mixers.PooledClassifier("mean"), "partial -> replicate for linear"),
    "last_token_classifier": (lambda: mixers.PooledClassifier("last"), "partial -> replicate for linear"),
    "last_token_reward_model": (lambda: mixers.PooledClassifier("last", classes=1), "partial -> replicate"),
}


def batch(length: int = LENGTH) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (2, length), generator=generator)
    return {"input_ids": ids, "label": torch.tensor([1, 2])}


def assert_exact(module: torch.nn.Module, sample: dict, world: int = 2):
    loss, grads = single_device(module, sample)
    simulated = simulate_step(module, sample, world)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4
    return simulated


@pytest.mark.parametrize("name", list(EXACT))
def test_token_mixers_are_exact(name: str) -> None:
    build, explained = EXACT[name]
    torch.manual_seed(0)
    simulated = assert_exact(build(), batch())
    lines = "\n".join(simulated.reports[0].lines())
    assert explained in lines, lines


def test_a_running_count_over_tokens_is_refused() -> None:
    """An MoE with capacity counts each expert's tokens in order: no layout keeps that exact."""
    torch.manual_seed(0)
    with pytest.raises(NotImplementedError, match=r"cumsum at .*mixer_modules\.py:\d+ .*flattened together"):
        simulate_step(mixers.CapacityMoELM(), batch(), 2)


def test_used_attention_weights_are_refused_with_the_fix() -> None:
    class WeightsLM(mixers.MultiheadAttentionLM):
        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            h = self.embed(batch["input_ids"])
            out, weights = self.attns[0](h, h, h)
            return out.sum() + weights.sum()

    with pytest.raises(NotImplementedError, match="Call it with need_weights=False"):
        simulate_step(WeightsLM(), batch(), 2)


def test_dead_code_elimination_keeps_in_place_writes() -> None:
    """``keys[..., :d].copy_(k)`` has no users but fills ``keys``: FX's own elimination drops it."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    buffer = graph.call_method("new_empty", (x, 4))
    view = graph.call_function(operator.getitem, (buffer, (Ellipsis, slice(0, 2))))
    graph.call_method("copy_", (view, x))
    graph.output(buffer)
    eliminate_dead_code(graph)
    assert [n.target for n in graph.nodes if n.op == "call_method"] == ["new_empty", "copy_"]
