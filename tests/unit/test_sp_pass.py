"""Graph-level tests of the SP pass on small Dynamo graphs, one rank at a time (no collective runs).

Each rank's graph is traced on its local shard (``shard_batch``), rewritten with ``sequence_parallel_pass``
and checked node by node; ``fake_propagate`` then pushes fake tensors through the rewritten graph, which
checks that every inserted op receives the shapes it expects.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.fx_utils import bind, example_value
from lightning_autosp.compiler.lower.masks import is_causal_mask
from lightning_autosp.compiler.lower.recompute import GlobalCopier
from lightning_autosp.compiler.prove.analysis import Analysis
from lightning_autosp.compiler.prove.layout import REPLICATE, SequenceTags, Tag, shard
from lightning_autosp.compiler.prove.plan import SequenceParallelRefusal
from lightning_autosp.compiler.prove.rules.common import SDPA_SIGNATURE
from lightning_autosp.compiler.sp_pass import SPContext, sequence_parallel_pass
from lightning_autosp.data import SequenceShard
from tests.distributed.modules import VOCAB, TinyGPT
from tests.unit.sp_graphs import (
    ALL_REDUCE_SUM,
    GROUP,
    HEAD_TO_SEQ,
    MODULES,
    SEQ_TO_HEAD,
    SEQ_TO_HEAD_PACKED,
    SEQUENCE_WINDOW,
    ancestors,
    capture,
    fake_propagate,
    fake_shape,
    global_batch,
    module,
    nodes_with_target,
    packed_all_to_all,
    pass_on,
    rewritten_step,
    sent_value,
    simulate_step,
    single_device,
    traced,
    training_step,
)
from tests.unit.sp_graphs import shard as shard_and_tag

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

KINDS = list(MODULES)
B = 2  # batch size of the traced steps


def output_values(gm: fx.GraphModule) -> tuple[fx.Node, ...]:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return tuple(output.args[0])


@dataclass
class Attention:
    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: object


def find_attention(gm: fx.GraphModule) -> list[Attention]:
    found = []
    for node in nodes_with_target(gm, F.scaled_dot_product_attention):
        args = bind(node, SDPA_SIGNATURE)
        found.append(Attention(node, args["query"], args["key"], args["value"], args["attn_mask"]))
    return found


# --------------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_gets_two_all_to_alls(kind: str, rank: int) -> None:
    """One for q, k and v together (Note [One all-to-all for q, k and v]), one for the output."""
    heads, head_dim = MODULES[kind][1:]
    rewritten = rewritten_step(kind, 24, 2, rank)
    gm, report = rewritten.gm, rewritten.report

    attention = find_attention(gm)
    assert len(attention) == 2  # two layers
    assert report.attention == [m.node.name for m in attention]
    assert report.all_to_alls == 2 * len(attention)
    assert nodes_with_target(gm, SEQ_TO_HEAD) == []
    assert len(nodes_with_target(gm, SEQ_TO_HEAD_PACKED)) == len(attention)
    assert len(nodes_with_target(gm, HEAD_TO_SEQ)) == len(attention)

    for match in attention:
        operands = (match.query, match.key, match.value)
        (packed, _), *others = [packed_all_to_all(operand) for operand in operands]
        assert [other for other, _ in others] == [packed, packed]
        assert traced(packed.args[1:]) == (1, 2, [12, 12], rank, GROUP)  # BHSD, seq_lens, rank, group
        for sent, operand in zip(packed.args[0], operands):
            in_heads = sent.meta["example_value"].shape[1]
            assert tuple(operand.meta["example_value"].shape) == (B, in_heads // 2, 24, head_dim)
        (back,) = match.node.users
        assert back.target is HEAD_TO_SEQ
        assert traced(back.args) == (match.node, 1, 2, [12, 12], rank, GROUP)
        assert tuple(match.query.meta["example_value"].shape) == (B, heads // 2, 24, head_dim)

    fake_propagate(gm, rewritten.example_inputs)
    for match in attention:
        assert fake_shape(match.node) == (B, heads // 2, 24, head_dim)
        assert fake_shape(next(iter(match.node.users))) == (B, heads, 12, head_dim)
    (loss,) = output_values(gm)
    assert fake_shape(loss) == ()


def test_head_to_seq_example_value_has_local_shape() -> None:
    gm = rewritten_step("gpt-causal", 24, 2, 1).gm
    for node in nodes_with_target(gm, HEAD_TO_SEQ):
        assert tuple(node.meta["example_value"].shape) == (B, 4, 12, 8)


def test_a_hidden_size_equal_to_the_shard_length_is_not_the_sequence() -> None:
    # hidden size 12 == the local length: parameters have a dim of 12 too, and stay replicated; only the
    # tagged token ids (and what is computed from them) carry the sequence
    sequence_shard = SequenceShard.balanced(24, 2, 1)
    tags = SequenceTags()
    ids = torch.zeros(B, sequence_shard.local_len, dtype=torch.long)
    tags.mark(ids, Tag(shard(1), (24,)))
    captured = capture(TinyGPT(dim=12, heads=4), ids)
    analysis = Analysis(captured.gm, captured.example_inputs, SPContext(sequence_shard, GROUP), tags).run()
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders if analysis.layout(n) != REPLICATE] == ["l_ids_"]
    assert [n.name for n in analysis.plan.positions] == ["arange"]
    assert not analysis.refusals


@pytest.mark.parametrize(
    ("kind", "gqa", "repeated"),
    [
        ("llama-kv1", True, True),  # 1 KV head over sp=2: replicated to 2 before the all-to-all
        ("llama-kv2", True, False),  # 2 KV heads split over sp=2 as they are
        # HF repeats K/V itself when it builds a mask (a tokenizer's attention_mask):
        ("llama-kv1-tokenized", False, True),  # its repeat to 4 heads undone: 1 head sent, replicated to 2
        ("llama-kv2-tokenized", False, False),  # its repeat undone: 2 heads sent, split as they are
    ],
)
def test_gqa_kv_heads(kind: str, gqa: bool, repeated: bool) -> None:
    rewritten = rewritten_step(kind, 24, 2, 0, gqa=gqa)
    gm, report = rewritten.gm, rewritten.report
    attention = find_attention(gm)
    assert all(m.node.kwargs["enable_gqa"] is True for m in attention)
    undone = [line for line in report.replicated_kv_heads if "paired by enable_gqa" in line]
    assert len(undone) == (0 if gqa else len(attention))
    for sent in [sent_value(match.key) for match in attention] + [
        sent_value(match.value) for match in attention
    ]:
        source = sent.args[0] if sent.target is torch.repeat_interleave else sent
        assert not (source.target == "reshape" and source.args[0].target == "expand")  # no repeat_kv left
    repeats = nodes_with_target(gm, torch.repeat_interleave)
    replicated = [line for line in report.replicated_kv_heads if line not in undone]
    if repeated:
        assert len(repeats) == 2 * len(attention)
        assert all(n.args[1] == 2 and n.kwargs == {"dim": 1} for n in repeats)
        for match in attention:
            assert sent_value(match.key).target is torch.repeat_interleave
            assert sent_value(match.value).target is torch.repeat_interleave
            assert sent_value(match.query).target is not torch.repeat_interleave
        assert len(replicated) == len(attention)
        assert all(line.endswith("1 -> 2") for line in replicated)
    else:
        assert repeats == []
        assert replicated == []

    fake_propagate(gm, rewritten.example_inputs)
    for match in attention:  # K/V cross the all-to-all with the heads the model has, not HF's copies
        assert fake_shape(match.key) == fake_shape(match.value) == (B, 1, 24, 8)
        assert fake_shape(match.query) == (B, 2, 24, 8)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world"), [(8, 2, 4), (4, 1, 2), (6, 3, 2), (12, 3, 4), (4, 2, 2)]
)
def test_gqa_replication_factor(heads: int, kv_heads: int, world: int) -> None:
    local = 5
    shard = SequenceShard.balanced(local * world, world, 1)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q = torch.randn(1, heads, local, 4)
    kv = torch.randn(1, kv_heads, local, 4)
    gm, report, inputs = pass_on(attention, shard, q, kv, kv.clone(), sharded={0: 2, 1: 2, 2: 2})

    repeats = world // math.gcd(kv_heads, world)
    inserted = nodes_with_target(gm, torch.repeat_interleave)
    if repeats == 1:
        assert inserted == [] and report.replicated_kv_heads == []
    else:
        assert [n.args[1] for n in inserted] == [repeats, repeats]
        assert report.replicated_kv_heads == [f"{report.attention[0]}: {kv_heads} -> {kv_heads * repeats}"]
    fake_propagate(gm, inputs)
    (match,) = find_attention(gm)
    assert fake_shape(match.key) == (1, kv_heads * repeats // world, local * world, 4)
    (out,) = output_values(gm)
    assert fake_shape(out) == (1, heads, local, 4)


class _PaddedToWholeChunks(torch.nn.Module):
    """A buffer the length of the sequence padded to whole chunks of 4: a remainder of the length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)

    def training_step(self, batch: dict, _: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        length = x.shape[1]
        chunks = x.new_zeros(x.shape[0], length + (4 - length % 4) % 4, 8)
        return x.sum() + chunks.sum()


def test_a_shape_no_rank_can_tell_its_part_of_is_refused_by_the_analysis() -> None:
    """Note [Refusals before rewriting]: the analysis refuses it, with the user's line, before lowering
    (which used to raise it halfway through its rewrites, without a line)."""
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        SequenceParallelRefusal, match=r"(?s)new_zeros at .*test_sp_pass.py:\d+.*not a multiple"
    ):
        simulate_step(_PaddedToWholeChunks(), {"input_ids": ids}, 2)


def test_heads_not_divisible_by_sp_size() -> None:
    shard = SequenceShard.balanced(24, 2, 0)
    ids = torch.zeros(B, shard.local_len, dtype=torch.long)
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(3\).*\[1, 3\]"):
        pass_on(TinyGPT(dim=24, heads=3), shard, ids, sharded={0: 1})


def test_untraced_flash_attention_is_rejected() -> None:
    # flash-attn 2.x's calls are rewritten (tests/unit/test_flash.py); a wrapper Dynamo kept opaque is not.
    @torch._dynamo.allow_in_graph
    def flash_attn_func(q, k, v):
        return q.clone()

    q = torch.zeros(1, 4, 2, 8)
    shard = SequenceShard.balanced(4, 2, 0)
    qkv = {0: 2, 1: 2, 2: 2}
    with pytest.raises(NotImplementedError, match="flash_attn_func is not an attention call"):
        pass_on(lambda q, k, v: flash_attn_func(q, k, v), shard, q, q.clone(), q.clone(), sharded=qkv)


def test_mask_from_a_float_per_token_input_is_rebuilt_from_the_gathered_input() -> None:
    # Token data of any dtype (no gradient) is gathered and the mask recomputed for the whole sequence.
    shard = SequenceShard.balanced(12, 2, 0)

    def attention(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :] > 0)

    q = torch.randn(1, 2, 6, 4)
    sharded = {0: 2, 1: 2, 2: 2, 3: 1}
    gm, report, _ = pass_on(attention, shard, q, q.clone(), q.clone(), torch.ones(1, 6), sharded=sharded)
    (gather,) = nodes_with_target(gm, torch.ops.autosp.gather_sequence.default)
    assert gather.args[0].name == "l_keep_"
    assert "rebuilt for the whole sequence" in report.masks[0]


def test_mask_from_activations_is_refused() -> None:
    shard = SequenceShard.balanced(12, 2, 0)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=q.sum(-1)[:, :, None, :] > 0)

    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attention mask computed from activations"):
        pass_on(attention, shard, q, q.clone(), q.clone(), sharded={0: 2, 1: 2, 2: 2})


def test_graph_without_attention() -> None:
    shard = SequenceShard.balanced(24, 2, 1)
    embedding = torch.nn.Embedding(VOCAB, 8)
    ids = torch.zeros(B, 12, dtype=torch.long)
    gm, report, _ = pass_on(lambda ids: embedding(ids).relu().sum(-1), shard, ids, sharded={0: 1})
    assert report.attention == [] and report.all_to_alls == 0
    assert not any(str(n.target).startswith("autosp.") for n in gm.graph.nodes)
    assert report.lines()[0] == "attention nodes: 0 (none)"


# --------------------------------------------------------------------------------------------------
# positions and masks


@pytest.mark.parametrize(
    ("kind", "global_len", "rank", "expected"),
    [
        ("gpt-causal", 24, 0, (0, 12)),
        ("gpt-causal", 24, 1, (12, 24)),
        ("gpt-causal", 61, 1, (31, 61)),
        ("llama-kv2", 24, 1, (12, 24)),
    ],
)
def test_positions_count_from_the_shard_offset(kind: str, global_len: int, rank: int, expected) -> None:
    rewritten = rewritten_step(kind, global_len, 2, rank)
    positions = [  # HF's mask is rebuilt for the whole sequence with its own aranges (copies, "_global")
        n for n in nodes_with_target(rewritten.gm, torch.arange) if not n.name.endswith("_global")
    ]
    assert [traced(n.args) for n in positions] == [expected]
    assert len(rewritten.report.positions) == 1


def test_only_aranges_over_the_sequence_length_become_positions() -> None:
    # B == S_r == 4 and a constant arange(4): the lengths are symbols, so neither is taken for positions.
    def step(ids):
        x = ids.float() + torch.arange(ids.shape[1])  # positions
        rows = torch.arange(ids.shape[0])  # batch indices, not positions
        fixed = torch.arange(4)  # a constant
        return (x * rows[:, None]).sum() + fixed.sum()

    sequence_shard = SequenceShard.balanced(8, 2, 1)
    gm, report, _ = pass_on(step, sequence_shard, torch.zeros(4, 4, dtype=torch.long), sharded={0: 1})
    aranges = nodes_with_target(gm, torch.arange)
    assert sorted(traced(n.args) for n in aranges) == [(4,), (4,), (4, 8)]
    assert len(report.positions) == 1


@pytest.mark.parametrize(("global_len", "rank"), [(24, 0), (24, 1), (61, 1)])
def test_window_mask_rebuilt_at_global_length(global_len: int, rank: int) -> None:
    rewritten = rewritten_step("gpt-window", global_len, 2, rank)
    gm, report = rewritten.gm, rewritten.report
    local = rewritten.shard.local_len
    attention = find_attention(gm)
    assert len(report.masks) == len(attention) == 2
    for match in attention:
        mask = match.node.kwargs["attn_mask"]
        ones = [n for n in ancestors(mask) if n.target is torch.ones]
        assert [traced(n.args[:2]) for n in ones] == [(global_len, global_len)]
        assert not match.node.kwargs["is_causal"]
    # the per-rank masks are gone (dead code after the rewrite)
    assert not [n for n in nodes_with_target(gm, torch.ones) if n.args[:2] == (local, local)]

    fake_propagate(gm, rewritten.example_inputs)
    for match in attention:
        assert fake_shape(match.node.kwargs["attn_mask"]) == (global_len, global_len)


@pytest.mark.parametrize("kind", ["gpt-triu", "llama-kv2"])
def test_plain_causal_mask_becomes_is_causal(kind: str) -> None:
    """A mask that is exactly causal (HF builds one) is dropped: no S x S tensor per rank."""
    rewritten = rewritten_step(kind, 24, 2, 1)
    attention = find_attention(rewritten.gm)
    assert len(attention) == 2
    for match in attention:
        assert match.node.kwargs["attn_mask"] is None and match.node.kwargs["is_causal"] is True
    assert all("is_causal=True" in line for line in rewritten.report.masks)
    assert not nodes_with_target(rewritten.gm, torch.ones)  # the mask's producers are dead code


def test_is_causal_mask_probes_past_the_window() -> None:
    """A sliding window equals causal at lengths below it: the probe must be longer than any constant."""
    for kind, causal in (("gpt-window", False), ("gpt-triu", True)):
        tags = SequenceTags()
        batch, sequence_shard = shard_and_tag(global_batch(B, 24), 2, 0, tags)
        captured = capture(training_step(kind), batch)
        context = SPContext(sequence_shard, GROUP)
        analysis = Analysis(captured.gm, captured.example_inputs, context, tags).run()
        copier = GlobalCopier(captured.gm, analysis, context)
        masks = [m.attn_mask for m in find_attention(captured.gm)]
        assert len(masks) == 2
        assert [is_causal_mask(copier, m) for m in masks] == [causal, causal]


@pytest.mark.parametrize("kind", ["llama-kv2", "gpt-window"])
def test_batch_size_equal_to_the_shard_length_is_exact(kind: str) -> None:
    # HF's mask is [B, 1, S, S]: with B == S_r the sizes are told apart by their symbols, not guessed.
    lightning_module = module(kind)
    batch = global_batch(12, 24)
    loss, grads = single_device(lightning_module, batch)
    simulated = simulate_step(lightning_module, batch, 2)
    for rank_loss in simulated.losses:
        torch.testing.assert_close(rank_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(simulated.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------------
# label shift and loss


@pytest.mark.parametrize(
    ("kind", "global_len", "world", "rank", "tokens"),
    [
        # GPT: logits[:, :-1] / ids[:, 1:] -> global S - 1 positions, cut at the shard boundaries
        ("gpt-causal", 24, 2, 0, 12),
        ("gpt-causal", 24, 2, 1, 11),
        ("gpt-causal", 61, 2, 0, 31),
        ("gpt-causal", 61, 2, 1, 29),
        ("gpt-causal", 26, 4, 0, 7),
        ("gpt-causal", 26, 4, 2, 6),
        ("gpt-causal", 26, 4, 3, 5),
        # HF: pad(labels, (0, 1), -100)[..., 1:] -> S positions, one per logit
        ("llama-kv2", 24, 2, 0, 12),
        ("llama-kv2", 24, 2, 1, 12),
        ("llama-kv2", 61, 2, 0, 31),
        ("llama-kv2", 61, 2, 1, 30),
    ],
)
def test_label_shift_fetches_the_next_shard_head(kind, global_len, world, rank, tokens) -> None:
    rewritten = rewritten_step(kind, global_len, world, rank)
    gm, report = rewritten.gm, rewritten.report
    (ids,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids_")]
    # one window of the labels on every rank, the last one included (it takes no row from another rank but
    # sends its first token back), so that the all-to-all inside matches across ranks
    (shift,) = nodes_with_target(gm, SEQUENCE_WINDOW)
    source, dim, starts, stops, seq_lens, *rest = traced(shift.args)
    assert ids in ancestors(source)
    offsets = [sum(seq_lens[:r]) for r in range(world)]
    # rank r's targets are positions o(r) + 1 .. o(r + 1) of the labels (HF's padded to S + 1), the last
    # rank's up to their end
    assert (dim, starts) == (1, [offset + 1 for offset in offsets])
    assert stops == [*(offset + 1 for offset in offsets[1:]), sum(seq_lens)]
    assert stops[rank] - starts[rank] == tokens
    assert rest == [rank, GROUP]
    assert len(report.slices) == 2

    fake_propagate(gm, rewritten.example_inputs)
    (cross_entropy,) = nodes_with_target(gm, F.cross_entropy)
    logits, target = cross_entropy.args[:2]
    assert fake_shape(logits) == (B * tokens, VOCAB)
    assert fake_shape(target) == (B * tokens,)


@pytest.mark.parametrize("kind", ["gpt-causal", "llama-kv2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_mean_loss_becomes_global_sum_over_global_count(kind: str, rank: int) -> None:
    rewritten = rewritten_step(kind, 24, 2, rank)
    gm = rewritten.gm
    (cross_entropy,) = nodes_with_target(gm, F.cross_entropy)
    assert cross_entropy.kwargs["reduction"] == "sum"
    # sum and count travel in one all-reduce, so no two ranks can issue them in different orders
    (totals,) = nodes_with_target(gm, ALL_REDUCE_SUM)
    stacked, group = totals.args
    assert group == GROUP and stacked.target is torch.stack
    (local_sum, local_count), *_ = stacked.args
    assert local_sum is cross_entropy and list(cross_entropy.users) == [stacked]
    assert local_count.target is torch.sum and local_count.kwargs == {"dtype": torch.float32}
    (valid,) = local_count.args
    assert valid.target is operator.ne and valid.args == (cross_entropy.args[1], -100)
    (loss,) = output_values(gm)
    assert loss.target is operator.truediv
    assert [(n.target, n.args) for n in loss.args] == [
        (operator.getitem, (totals, 0)),
        (operator.getitem, (totals, 1)),
    ]
    assert len(rewritten.report.losses) == 1

    fake_propagate(gm, rewritten.example_inputs)
    assert fake_shape(totals) == (2,) and fake_shape(loss) == ()


def test_sum_loss_is_all_reduced() -> None:
    shard = SequenceShard.balanced(24, 2, 1)

    def loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    logits, labels = torch.randn(B, 12, 7), torch.zeros(B, 12, dtype=torch.long)
    gm, report, _ = pass_on(loss, shard, logits, labels, sharded={0: 1, 1: 1})
    (cross_entropy,) = nodes_with_target(gm, F.cross_entropy)
    (total,) = nodes_with_target(gm, ALL_REDUCE_SUM)
    assert total.args == (cross_entropy, GROUP)
    assert output_values(gm) == (total,)
    (move,) = report.redistributions  # explain() lists the move: value, layouts, op, collective, bytes
    assert (
        move.startswith(f"{cross_entropy.name} partial -> replicate for output at ") and "all-reduce" in move
    )


class SplitThenHead(torch.nn.Module):
    """The logits come from the halves of a split (a tuple), with no residual to carry the layout."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        gate, value = self.embedding(ids).split(8, dim=2)
        logits = self.head(gate.sigmoid() * value)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_layout_survives_a_split() -> None:
    shard = SequenceShard.balanced(24, 2, 0)
    ids = torch.zeros(B, shard.local_len, dtype=torch.long)
    gm, report, inputs = pass_on(SplitThenHead(), shard, ids, sharded={0: 1})
    assert len(report.slices) == 2  # logits[:, :-1] and ids[:, 1:]
    fake_propagate(gm, inputs)


def test_loss_without_sharded_inputs_is_left_alone() -> None:
    shard = SequenceShard.balanced(24, 2, 0)

    def losses(ids, logits, target):
        return ids.float().mean(), F.cross_entropy(logits, target)

    ids, logits, target = torch.zeros(B, 12, dtype=torch.long), torch.randn(5, 7), torch.zeros(5).long()
    gm, report, _ = pass_on(losses, shard, ids, logits, target, sharded={0: 1})
    (cross_entropy,) = nodes_with_target(gm, F.cross_entropy)
    assert cross_entropy.kwargs.get("reduction", "mean") == "mean"
    # the mean over the sharded ids is a sum, made whole once, over the global count
    (total,) = nodes_with_target(gm, ALL_REDUCE_SUM)
    mean, loss = output_values(gm)
    assert (
        mean is total and total.args[0].target is operator.truediv and traced(total.args[0].args[1]) == B * 24
    )
    assert loss is cross_entropy


def test_unreduced_loss_stays_per_token() -> None:
    shard = SequenceShard.balanced(24, 2, 0)

    def loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")

    logits, labels = torch.randn(B, 12, 7), torch.zeros(B, 12, dtype=torch.long)
    gm, report, _ = pass_on(loss, shard, logits, labels, sharded={0: 1, 1: 1})
    assert nodes_with_target(gm, ALL_REDUCE_SUM) == []
    assert report.output_tags[0].layout.dims == (0,)  # one loss per (flattened) token


def test_hand_written_attention_runs_on_the_whole_sequence_for_a_block_of_a_batch_dim() -> None:
    """softmax(QK^T)V over a shard sees only the shard's tokens: q, k and v go to the whole sequence for a
    block of a dim attention treats independently (here the batch: the one head does not divide), and
    the output comes back (Note [Redistribution])."""

    def step(x):
        q = k = v = x.unsqueeze(1)  # (B, 1, T, C)
        scores = (q @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, 1, T, T)
        return (scores @ v).sum()

    shard = SequenceShard.balanced(24, 2, 0)
    x = torch.randn(B, shard.local_len, 8, requires_grad=True)
    gm, report, inputs = pass_on(step, shard, x, sharded={0: 1})
    to_blocks = nodes_with_target(gm, SEQ_TO_HEAD)
    # q (also v: the same value, moved once) and k^T: the batch dim cut, the tokens gathered
    assert [n.args[1:3] for n in to_blocks] == [(0, 2), (0, 3)]
    *moves, total = report.redistributions  # the sum of the blocks is a partial sum: no way back needed
    assert len(moves) == 3 and all("all-to-all" in line for line in moves) and "all-reduce" in total
    fake_propagate(gm, inputs)
    assert fake_shape(to_blocks[0]) == (B // 2, 1, 24, 8)


def test_hand_written_attention_is_refused_when_no_dim_divides() -> None:
    def step(x):
        q = k = v = x.unsqueeze(1)  # (1, 1, T, C): neither the batch nor the heads divide by 2
        return ((q @ k.transpose(-2, -1)).softmax(dim=-1) @ v).sum()

    shard = SequenceShard.balanced(24, 2, 0)
    x = torch.randn(1, shard.local_len, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"attention written by hand.*sizes \[1, 1, 'S', 8\]"):
        pass_on(step, shard, x, sharded={0: 1})


def test_q_and_k_cross_the_all_to_all_in_autocasts_dtype() -> None:
    # HF's rotary embeddings leave q and k in float32 under bf16 autocast (cos/sin are float32); SDPA
    # would cast them to bf16 after the all-to-all anyway, so the pass casts before it: half the bytes.
    tags = SequenceTags()
    batch, sequence_shard = shard_and_tag(global_batch(2, 24), 2, 0, tags)
    step = training_step("llama-kv2")

    def autocast_step(batch: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(batch)

    captured = capture(autocast_step, batch)
    context = SPContext(sequence_shard, GROUP)
    gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, context, tags)
    inputs = [t for n in nodes_with_target(gm, SEQ_TO_HEAD_PACKED) for t in n.args[0]]
    assert len(inputs) == 6
    assert {example_value(n).dtype for n in inputs} == {torch.bfloat16}
    assert len(report.casts) == 4 and all(line.endswith("float32 -> torch.bfloat16") for line in report.casts)


def test_rewriting_runs_no_saved_tensor_hooks(gloo_group: str) -> None:
    """The pass computes fake values for the nodes it adds without autograd, so a user's saved-tensor
    hooks (MemoryMonitor's) are not called while compiling, which would make them unusable."""
    from lightning_autosp.compiler.backend import AutoSPBackend

    torch.manual_seed(0)
    model = TinyGPT()
    ids = torch.randint(0, VOCAB, (1, 16))
    tags = SequenceTags()
    tags.mark(ids, Tag(shard(1), (16,)))
    context = SPContext(SequenceShard.balanced(16, 1, 0), gloo_group)
    backend = AutoSPBackend(context, tags=tags, compiler="aot_eager")
    packed_while_compiling = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            packed_while_compiling.append(tuple(tensor.shape))
        return tensor

    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.compile(lambda x: model(x).sum(), backend=backend, dynamic=False)(ids).backward()
    assert backend.reports and backend.reports[0].all_to_alls > 0
    assert packed_while_compiling == []
