"""Packed documents under SP: masks rebuilt from gathered per-token inputs (Note [Masks over the whole
sequence] in compiler/lower/masks.py).

Graphs per rank, then every rank's rewritten graph run with the ranks as threads against one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.runtime.ops import gather_sequence
from lightning_autosp.compiler.sp_pass import SPContext, sequence_parallel_pass
from lightning_autosp.data import SequenceShard
from tests.distributed.attention_modules import (
    DocumentMaskGPTModule,
    PackedLlamaModule,
    PaddedLlamaModule,
    packed_inputs,
)
from tests.distributed.modules import VOCAB
from tests.unit.sp_graphs import (
    GROUP,
    ancestors,
    capture,
    concrete,
    fake_propagate,
    fake_shape,
    nodes_with_target,
    pass_on,
    run_ranks,
    shard,
    traced,
)
from tests.unit.test_sp_pass import find_attention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

GATHER = torch.ops.autosp.gather_sequence.default
MODULES = {"llama": PackedLlamaModule, "gpt": DocumentMaskGPTModule, "llama-padded": PaddedLlamaModule}


def make_module(kind: str):
    torch.manual_seed(0)
    return MODULES[kind]()


def packed_batch(batch_size: int, documents: tuple[int, ...]) -> dict[str, torch.Tensor]:
    length = sum(documents)
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (batch_size, length), generator=generator)
    return {"input_ids": ids, "position_ids": packed_inputs(documents)["position_ids"].expand(batch_size, -1)}


def rewrite(module, batch: dict, world: int, rank: int):
    tags = SequenceTags()
    local, sequence_shard = shard(batch, world, rank, tags)
    captured = capture(lambda b: module.training_step(b, 0), local)
    context = SPContext(sequence_shard, GROUP)
    gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, context, tags)
    return gm, report, concrete(captured.example_inputs), sequence_shard


# --------------------------------------------------------------------------------------------------
# graphs


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("rank", [1])
def test_mask_is_rebuilt_from_gathered_position_ids(kind: str, rank: int) -> None:
    gm, report, inputs, shard = rewrite(make_module(kind), packed_batch(2, (7, 11, 7)), 2, rank)
    (positions,) = [n for n in gm.graph.nodes if n.op == "placeholder" and "position_ids" in n.name]
    (gathered,) = nodes_with_target(gm, GATHER)  # once per graph, for both layers
    assert traced(gathered.args) == (positions, 1, [13, 12], GROUP)
    attention = find_attention(gm)
    assert len(attention) == 2 and len(report.masks) == 2
    masks = {match.node.kwargs["attn_mask"] for match in attention}
    assert len(masks) == 1  # one rebuilt mask serves both layers
    (mask,) = masks
    # the mask sees the row's positions only through the gather: no per-rank position reaches it
    assert gathered in ancestors(mask)
    assert positions not in ancestors(mask) - ancestors(gathered)

    fake_propagate(gm, inputs)
    assert fake_shape(gathered) == (2, 25)
    assert fake_shape(mask) == (2, 1, 25, 25)


def test_mask_handed_to_the_next_graph_is_rebuilt_from_gathered_inputs() -> None:
    """DDP's split can put the mask and the attentions in different graphs: the producer side."""

    def documents_mask(position_ids):
        documents = (position_ids == 0).cumsum(-1)
        causal = torch.ones(position_ids.shape[1], position_ids.shape[1], dtype=torch.bool).tril()
        return (documents[:, :, None] == documents[:, None, :]) & causal

    batch = packed_batch(2, (7, 11, 7))
    sequence_shard = SequenceShard.balanced(25, 2, 1)
    position_ids = batch["position_ids"].narrow(1, 13, 12).clone()
    gm, report, inputs = pass_on(documents_mask, sequence_shard, position_ids, sharded={0: 1})
    assert len(nodes_with_target(gm, GATHER)) == 1
    assert [line.split(": ", 1)[1] for line in report.masks] == ["handed on rebuilt for the whole sequence"]
    assert report.output_tags[0].layout.kind == "global"
    fake_propagate(gm, inputs)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert fake_shape(output.args[0][0]) == (2, 25, 25)


# --------------------------------------------------------------------------------------------------
# numbers


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "documents", "world"),
    [
        ("llama", (5, 13, 8), 4),  # shards 7 + 7 + 6 + 6: the middle document spans three ranks
        ("gpt", (9, 4, 13), 4),  # a short document inside rank 1, a long one over ranks 1 to 3
    ],
)
def test_training_step_matches_single_device(kind: str, documents: tuple[int, ...], world: int) -> None:
    module = make_module(kind)
    batch = packed_batch(1 if kind == "llama" else 2, documents)
    assert_matches_single_device(module, batch, world)
    # negative control: the same row attending across documents gives another loss
    expected = module.training_step(batch, 0).item()
    assert abs(module.cross_document_loss(batch) - expected) > 1e-4 * expected


def test_hf_padding_attention_mask_matches_single_device() -> None:
    """The padding mask is per-token integer data too: gathered, and HF's mask rebuilt from it."""
    module = make_module("llama-padded")
    batch = packed_batch(2, (25,))
    batch["attention_mask"] = torch.ones(2, 25, dtype=torch.long)
    batch["attention_mask"][1, 10:] = 0  # row 1 padded from inside rank 0's shard (13 + 12)
    assert_matches_single_device(module, batch, 2)


def assert_matches_single_device(module, batch: dict, world: int) -> None:
    params = list(module.parameters())
    expected = module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    graphs = [rewrite(module, batch, world, rank) for rank in range(world)]

    def rank_fn(rank: int):
        gm, _, inputs, _ = graphs[rank]
        (loss,) = gm(*inputs)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    results, comm = run_ranks(world, rank_fn)
    assert comm.calls[0][0] == "all_gather"  # the per-token data, before any all-to-all
    for loss, _ in results:
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for index, expected_grad in enumerate(expected_grads):
        mean = torch.stack([grads[index] for _, grads in results]).mean(0)
        torch.testing.assert_close(mean, expected_grad, rtol=1e-4, atol=1e-6)


def test_key_padding_mask_from_an_integer_input() -> None:
    """Any mask computed from integer per-token inputs alone is rebuilt, a padding mask too."""
    world, length = 2, 12
    q, k, v = (torch.randn(1, 2, length, 4) for _ in range(3))
    keep = torch.ones(1, length, dtype=torch.long)
    keep[0, 3:5] = 0  # two padded keys in rank 0's shard

    def attention(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] > 0)

    expected = attention(q, k, v, keep)
    shards = [SequenceShard.balanced(length, world, rank) for rank in range(world)]

    def local(x, shard, dim):
        return x.narrow(dim, shard.offset, shard.local_len)

    graphs = []
    for sequence_shard in shards:
        args = (*(local(t, sequence_shard, 2) for t in (q, k, v)), local(keep, sequence_shard, 1))
        gm, _, inputs = pass_on(attention, sequence_shard, *args, sharded={0: 2, 1: 2, 2: 2, 3: 1})
        graphs.append((gm, inputs))
    results, _ = run_ranks(world, lambda rank: graphs[rank][0](*graphs[rank][1])[0])
    torch.testing.assert_close(torch.cat(results, dim=2), expected)


# --------------------------------------------------------------------------------------------------
# refusals


def test_mask_from_activations_is_refused() -> None:
    gate = torch.nn.Linear(4, 1)

    def attention(q, k, v, x):
        keep = gate(x).squeeze(-1) > 0  # (B, S_r) from a learned projection
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    q = torch.randn(1, 2, 6, 4)
    sequence_shard = SequenceShard.balanced(12, 2, 0)
    with pytest.raises(NotImplementedError, match="mask computed from activations or parameters"):
        pass_on(
            attention,
            sequence_shard,
            q,
            q.clone(),
            q.clone(),
            torch.randn(1, 6, 4),
            sharded={0: 2, 1: 2, 2: 2, 3: 1},
        )


def test_gather_sequence_op(gloo_group: str) -> None:
    x = torch.arange(12).view(2, 6)
    torch.library.opcheck(GATHER, (x, 1, [6], gloo_group))
    with pytest.raises(TypeError, match="without gradients"):
        gather_sequence(x.float().requires_grad_(), 1, [6], gloo_group)


def test_gather_sequence_across_uneven_shards() -> None:
    full = torch.arange(16).view(2, 8)
    shards = [SequenceShard.balanced(8, 3, rank) for rank in range(3)]  # 3 + 3 + 2

    def rank_fn(rank: int) -> torch.Tensor:
        shard = shards[rank]
        return gather_sequence(full.narrow(1, shard.offset, shard.local_len), 1, list(shard.seq_lens), "sim")

    results, _ = run_ranks(3, rank_fn)
    assert all(torch.equal(result, full) for result in results)
