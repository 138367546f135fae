"""Ulysses x ring: the sequence layouts, the ring attention ops (opcheck, and every ring rank run as a
thread against single-device SDPA), and the sp = ulysses x ring configuration checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

import lightning_autosp.strategy as strategy_module
from lightning_autosp.compiler.lower.slices import fetch_plan
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.runtime import ops as collectives
from lightning_autosp.compiler.runtime.ring import find_blocks, ring_args
from lightning_autosp.compiler.sp_pass import SPContext, sequence_parallel_pass
from lightning_autosp.data import SequenceShard, in_sequence_order, shard_batch
from lightning_autosp.mesh import (
    auto_ulysses_degree,
    check_ulysses_degree,
    check_ulysses_degree_option,
    find_head_counts,
)
from lightning_autosp.strategy import AutoSPStrategy
from tests.distributed.modules import VOCAB, GPTModule, LlamaModule
from tests.unit.sp_graphs import (
    GROUP,
    SEQ_TO_HEAD_PACKED,
    capture,
    concrete,
    fake_propagate,
    fake_shape,
    global_batch,
    nodes_with_target,
    run_ranks,
    shard,
    training_step,
)

ops = torch.ops.autosp


def layout(global_len: int, world: int, ring_degree: int, kind: str) -> list[SequenceShard]:
    return [SequenceShard.for_ring(global_len, world, rank, ring_degree, kind) for rank in range(world)]


# --------------------------------------------------------------------------------------------------
# the layouts


def test_zigzag_gives_ring_rank_i_chunks_i_and_2r_minus_1_minus_i() -> None:
    # 16 tokens, 2 ring ranks x 2 Ulysses ranks: chunks of 4; ring rank 0 = chunks 0 and 3.
    shards = layout(16, 4, 2, "zigzag")
    assert [s.ranges for s in shards] == [((0, 4),), ((12, 16),), ((4, 8),), ((8, 12),)]
    assert [s.ring_rank for s in shards] == [0, 0, 1, 1]
    assert [s.ulysses_seq_lens for s in shards] == [(4, 4)] * 4
    assert shards[0].ring_ranges(0) == ((0, 4), (12, 16))
    assert shards[0].ring_ranges(1) == ((4, 12),)  # chunks 1 and 2 touch: one range
    assert ring_args(shards[3]) == ([0, 4, 12, 16, 4, 12], [2, 1], 1)


@pytest.mark.parametrize(
    ("global_len", "world", "ring_degree"), [(30, 4, 2), (31, 6, 3), (30, 4, 4), (12, 8, 4)]
)
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_every_token_has_one_owner_in_ascending_local_order(global_len, world, ring_degree, kind) -> None:
    shards = layout(global_len, world, ring_degree, kind)
    owned = [s.positions() for s in shards]
    assert sorted(p for positions in owned for p in positions) == list(range(global_len))
    assert all(positions == sorted(positions) for positions in owned)
    assert [len(p) for p in owned] == list(shards[0].seq_lens)
    # a right pad belongs to the owner of the last token, at the end of its shard
    last_owner = next(r for r, positions in enumerate(owned) if global_len - 1 in positions)
    assert shards[last_owner].positions(global_len + 1)[-1] == global_len


@pytest.mark.parametrize(("kind", "imbalance"), [("zigzag", 1.0), ("contiguous", 904 / 136)])
def test_zigzag_balances_causal_work_over_the_ring(kind: str, imbalance: float) -> None:
    shard = SequenceShard.for_ring(64, 8, 0, 4, kind)
    # (query, key) pairs under a causal mask, per ring rank
    work = [sum(p + 1 for start, end in shard.ring_ranges(i) for p in range(start, end)) for i in range(4)]
    assert max(work) / min(work) == imbalance, work


def test_ring_degree_1_is_the_balanced_layout() -> None:
    for kind in ("zigzag", "contiguous"):
        assert SequenceShard.for_ring(61, 2, 1, 1, kind) == SequenceShard.balanced(61, 2, 1)


def test_shard_batch_follows_the_zigzag_map() -> None:
    ids = torch.arange(16).view(1, 16)
    batch, shard = shard_batch({"input_ids": ids, "other": torch.zeros(3)}, world=4, rank=1, ring_degree=4)
    assert batch["input_ids"].tolist() == [shard.positions()] == [[2, 3, 12, 13]]
    assert batch["other"].shape == (3,)


def test_too_short_for_zigzag_names_the_minimum() -> None:
    with pytest.raises(ValueError, match="needs at least 8"):
        SequenceShard.for_ring(7, 4, 0, 4, "zigzag")


def test_offset_refuses_non_contiguous_shards() -> None:
    with pytest.raises(RuntimeError, match="contiguous shards only"):
        _ = SequenceShard.for_ring(16, 4, 1, 2, "zigzag").offset


# --------------------------------------------------------------------------------------------------
# sp = ulysses x ring


def test_ulysses_degree_must_factor_sp() -> None:
    check_ulysses_degree(8, 2)
    with pytest.raises(ValueError, match=r"ulysses_degree=3 must divide sp_size=8.*\[1, 2, 4, 8\]"):
        check_ulysses_degree(8, 3)
    for bad in (0, -2, 2.0, True, "max"):
        with pytest.raises(ValueError, match="ulysses_degree must be"):
            check_ulysses_degree_option(bad)


def test_auto_ulysses_degree_divides_heads_sp_and_node() -> None:
    assert auto_ulysses_degree(sp_size=4, heads=2, devices_per_node=4) == 2
    assert auto_ulysses_degree(sp_size=8, heads=32, devices_per_node=8) == 8
    assert auto_ulysses_degree(sp_size=16, heads=32, devices_per_node=8) == 8  # a2a inside the node
    assert auto_ulysses_degree(sp_size=4, heads=3, devices_per_node=4) == 1  # all ring


# --------------------------------------------------------------------------------------------------
# the ring attention ops


def test_blocks_of_a_causal_zigzag_step() -> None:
    # ring rank 1 of 2 holds [4, 12); ring rank 0's block is [0, 4) + [12, 16)
    blocks = find_blocks([(4, 12)], [(0, 4), (12, 16)], is_causal=True, masked=False)
    assert [(b.kv_range, b.kind) for b in blocks] == [((0, 4), "full")]  # [12, 16) is in the future
    blocks = find_blocks([(0, 4), (12, 16)], [(4, 12)], is_causal=True, masked=False)
    assert [(b.q_range, b.kind) for b in blocks] == [((12, 16), "full")]
    blocks = find_blocks([(0, 4), (12, 16)], [(0, 4), (12, 16)], is_causal=True, masked=False)
    assert [(b.q_range, b.kv_range, b.kind) for b in blocks] == [
        ((0, 4), (0, 4), "causal"),
        ((12, 16), (0, 4), "full"),
        ((12, 16), (12, 16), "causal"),
    ]


def _qkv(kv_heads: int, length: int, dtype=torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(kv_heads + length)
    shapes = [(2, 4, length, 8), (2, kv_heads, length, 8), (2, kv_heads, length, 8)]
    return [torch.randn(*shape, generator=generator, dtype=dtype) for shape in shapes]


def test_opcheck_ring_attention(gloo_group: str) -> None:
    query, key, value = (t.requires_grad_() for t in _qkv(2, 12))
    args = ([0, 5, 5, 12], [2], 0, gloo_group)  # one ring rank holding two ranges
    torch.library.opcheck(ops.ring_attention, (query, key, value, None, True, None, *args))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.library.opcheck(ops.ring_attention, (query, key, value, mask, False, 0.3, *args))
    out, lse = ops.ring_attention(query, key, value, None, True, None, *args)
    detached = [t.detach() for t in (torch.randn_like(out), query, key, value, out, lse)]
    torch.library.opcheck(ops.ring_attention_backward, (*detached, None, True, None, *args))


@pytest.mark.parametrize(
    ("global_len", "ring_degree", "kind", "mask", "kv_heads", "dtype"),
    [
        (16, 2, "contiguous", "causal", 4, torch.float64),
        (30, 3, "zigzag", "causal", 2, torch.float64),  # uneven chunks (5, 5, 5, 5, 5, 5), GQA
        (31, 2, "zigzag", "triu", 1, torch.float64),  # an explicit mask, cut per block
        (13, 3, "zigzag", "none", 4, torch.float64),  # not causal: every block is full
        (32, 4, "zigzag", "causal", 2, torch.float32),  # the CPU flash kernel's fp32 rounding
    ],
)
def test_ring_attention_across_ranks_matches_sdpa(
    global_len, ring_degree, kind, mask, kv_heads, dtype
) -> None:
    full = [t.requires_grad_() for t in _qkv(kv_heads, global_len, dtype)]
    attn_mask = torch.ones(global_len, global_len, dtype=torch.bool).tril() if mask == "triu" else None
    is_causal = mask == "causal"
    expected = F.scaled_dot_product_attention(
        *full, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
    )
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, full, grad_out)
    shards = layout(global_len, ring_degree, ring_degree, kind)  # ring only: one Ulysses rank each

    def rank_fn(rank: int):
        index = torch.tensor(shards[rank].positions())
        local = [t.detach()[:, :, index].requires_grad_() for t in full]
        out, _ = ops.ring_attention(
            *local, attn_mask, is_causal, None, *ring_args(shards[rank])[:2], rank, "sim"
        )
        grads = torch.autograd.grad(out, local, grad_out[:, :, index])
        return index, out.detach(), grads

    results, comm = run_ranks(ring_degree, rank_fn)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    key_grads = [torch.zeros_like(t) for t in full]
    for index, out, (grad_q, grad_k, grad_v) in results:
        torch.testing.assert_close(out, expected.detach()[:, :, index], **tolerance)
        torch.testing.assert_close(grad_q, expected_grads[0][:, :, index], **tolerance)
        key_grads[1][:, :, index] = grad_k  # each rank's K/V gradient came home with its block
        key_grads[2][:, :, index] = grad_v
    torch.testing.assert_close(key_grads[1], expected_grads[1], **tolerance)
    torch.testing.assert_close(key_grads[2], expected_grads[2], **tolerance)
    # forward R - 1 K/V hops, backward R - 1 K/V hops plus R gradient hops; the same on every rank
    assert comm.calls[0].count("isend") == 3 * ring_degree - 2
    assert all(calls == comm.calls[0] for calls in comm.calls)


# --------------------------------------------------------------------------------------------------
# slices of a zigzag-sharded sequence (the label shift)


def test_fetching_rows_on_the_only_rank(gloo_group: str) -> None:
    shard = SequenceShard.balanced(6, 1, 0)
    fetch = fetch_plan(shard, 6, 1, 5)  # x[:, 1:] on one rank: a narrow, nothing to fetch
    assert (fetch.sends, fetch.receives, fetch.take, fetch.narrow) == ([[]], [0], [1, 2, 3, 4, 5], True)
    x = torch.arange(6.0).view(1, 6).requires_grad_()
    rows = collectives.fetch_rows(x, 1, [[]], [0], [5, 0, 2, 2], gloo_group)  # any order, repeats
    assert rows.flatten().tolist() == [5.0, 0.0, 2.0, 2.0]
    rows.sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 0.0, 2.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(("global_len", "world", "ring_degree"), [(16, 4, 2), (30, 4, 4), (13, 3, 3)])
@pytest.mark.parametrize(("start", "shrink"), [(1, 1), (0, 1), (2, 2), (1, 0)])
def test_fetched_rows_slice_the_global_sequence(global_len, world, ring_degree, start, shrink) -> None:
    """``x[:, start : S - shrink + start]`` of the global sequence (``shrink=0``: after a right pad)."""
    in_len = global_len + (1 if shrink == 0 else 0)  # (1, 0): HF's pad(labels, (0, 1)) then [..., 1:]
    out_len = in_len - start - (shrink if shrink else 0)
    full = torch.randn(2, in_len, dtype=torch.float64)
    shards = layout(global_len, world, ring_degree, "zigzag")
    weights = [torch.randn(2, len(s.positions(out_len)), dtype=torch.float64) for s in shards]

    def rank_fn(rank: int):
        shard = shards[rank]
        x = full[:, shard.positions(in_len)].clone().requires_grad_()
        fetch = fetch_plan(shard, in_len, start, out_len)
        out = collectives.fetch_rows(x, 1, fetch.sends, fetch.receives, fetch.take, "sim")
        (out * weights[rank]).sum().backward()
        return x, out.detach()

    results, comm = run_ranks(world, rank_fn)
    expected_grad = torch.zeros_like(full)
    for sequence_shard, weight, (_, out) in zip(shards, weights, results):
        owned = [p + start for p in sequence_shard.positions(out_len)]
        torch.testing.assert_close(out, full[:, owned], rtol=0, atol=0)
        expected_grad[:, owned] += weight
    for sequence_shard, (x, _) in zip(shards, results):
        torch.testing.assert_close(x.grad, expected_grad[:, sequence_shard.positions(in_len)])
    assert all(calls == comm.calls[0] for calls in comm.calls)


# --------------------------------------------------------------------------------------------------
# the SP pass with a ring group


def ring_rewritten(kind: str, global_len: int, world: int, ring_degree: int, rank: int) -> tuple:
    tags = SequenceTags()
    batch, sequence_shard = shard(
        global_batch(2, global_len), world, rank, tags, ring_degree=ring_degree, ring_layout="zigzag"
    )
    captured = capture(training_step(kind), batch)
    ctx = SPContext(sequence_shard, GROUP, ulysses_group_name="ulysses_group", ring_group_name="ring_group")
    gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, ctx, tags)
    return gm, report, concrete(captured.example_inputs), sequence_shard


@pytest.mark.usefixtures("fresh_dynamo")
def test_attention_is_lowered_to_all_to_all_then_ring() -> None:
    # 4 heads, sp=8 = Ulysses 4 x ring 2; ring rank 0 holds chunks [0, 9) + [27, 36), and its Ulysses
    # rank 1 (sp rank 1) the 5 tokens [5, 9) + [27, 28)
    gm, report, example_inputs, shard = ring_rewritten("gpt-causal", 36, 8, 2, 1)
    assert shard.ranges == ((5, 9), (27, 28))
    assert not nodes_with_target(gm, F.scaled_dot_product_attention)
    rings = nodes_with_target(gm, ops.ring_attention.default)
    assert len(rings) == len(report.ring_attention) == 2
    bounds, counts, ring_rank, group = rings[0].args[-4:]
    assert (bounds, counts, ring_rank, group) == ([0, 9, 27, 36, 9, 27], [2, 1], 0, "ring_group")
    seq_lens, ulysses_rank, group = nodes_with_target(gm, SEQ_TO_HEAD_PACKED)[0].args[-3:]
    assert (seq_lens, ulysses_rank, group) == ([5, 5, 4, 4], 1, "ulysses_group")
    assert nodes_with_target(gm, collectives.fetch_rows)  # the label shift crosses ranges
    ranges = "this rank's -> [5, 9), [27, 28)"
    assert any(line.endswith(ranges) for line in report.positions), report.positions
    fake_propagate(gm, example_inputs)
    assert fake_shape(next(iter(rings[0].users))) == (
        2,
        1,
        18,
        8,
    )  # [B, H/U, L_i, D]: ring rank 0 holds 18 tokens


@pytest.mark.usefixtures("fresh_dynamo")
def test_ulysses_degree_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"ulysses_degree=3 must divide the number of attention heads \(4\)"):
        ring_rewritten("gpt-causal", 26, 6, 2, 0)


# --------------------------------------------------------------------------------------------------
# AutoSPStrategy(ulysses_degree=..., ring_layout=...)


@pytest.fixture
def four_cpu_ranks(monkeypatch: pytest.MonkeyPatch):
    """A strategy factory for global rank 1 of 4 CPU processes (no process group)."""
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0), raising=False)
    for name in ("NODE_RANK", "GROUP_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")

    def make(**kwargs) -> AutoSPStrategy:
        strategy = AutoSPStrategy(
            sp_size=4,
            parallel_devices=[torch.device("cpu")] * 4,
            cluster_environment=LightningEnvironment(),
            **kwargs,
        )
        strategy.set_world_ranks()
        return strategy

    return make


def test_strategy_refuses_bad_ulysses_options(four_cpu_ranks) -> None:
    with pytest.raises(ValueError, match="ulysses_degree must be a positive integer, 'auto' or None"):
        AutoSPStrategy(ulysses_degree=0)
    with pytest.raises(ValueError, match="ring_layout='spiral' is not supported"):
        AutoSPStrategy(ring_layout="spiral")
    with pytest.raises(ValueError, match=r"ulysses_degree=3 must divide sp_size=4.*\[1, 2, 4\]"):
        four_cpu_ranks(ulysses_degree=3)  # in set_world_ranks, before any process group


def test_batch_to_device_shards_by_the_ring_layout(four_cpu_ranks) -> None:
    ids = torch.arange(32).view(2, 16)
    # No process group in this test: the same-sample check (an all-gather) is off.
    strategy = four_cpu_ranks(ulysses_degree=2, check_samples=False)
    assert (strategy.ulysses_degree, strategy.ring_degree) == (2, 2)
    assert strategy.batch_to_device({"input_ids": ids})["input_ids"].tolist() == [
        [12, 13, 14, 15],
        [28, 29, 30, 31],
    ]
    contiguous = four_cpu_ranks(ulysses_degree=2, ring_layout="contiguous", check_samples=False)
    assert torch.equal(contiguous.batch_to_device({"input_ids": ids})["input_ids"], ids[:, 4:8])
    plain = four_cpu_ranks(check_samples=False)
    assert torch.equal(plain.batch_to_device({"input_ids": ids})["input_ids"], ids[:, 4:8])


def test_auto_ulysses_degree_reads_the_heads_off_the_module(four_cpu_ranks, monkeypatch) -> None:
    assert find_head_counts(GPTModule(heads=2)) == {2}
    assert find_head_counts(LlamaModule(heads=2, kv_heads=1)) == {2}
    meshes = []
    monkeypatch.setattr(
        strategy_module, "build_ring_ulysses_mesh", lambda *args: meshes.append(args) or "mesh"
    )
    strategy = four_cpu_ranks(ulysses_degree="auto")
    with pytest.raises(RuntimeError, match="resolved in setup"):
        _ = strategy.ring_degree
    monkeypatch.setattr(AutoSPStrategy, "lightning_module", GPTModule(heads=2))
    strategy._setup_ring()
    assert (strategy.ulysses_degree, strategy.ring_degree) == (2, 2)
    assert meshes == [("cpu", 4, 4, 2, strategy._timeout)]
    monkeypatch.setattr(AutoSPStrategy, "lightning_module", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="found no attention head count"):
        four_cpu_ranks(ulysses_degree="auto")._setup_ring()


def test_predict_outputs_go_back_to_sequence_order() -> None:
    shard = SequenceShard.for_ring(16, 4, 0, 2, "zigzag")
    in_rank_order = torch.tensor([p for rank in range(4) for p in shard.positions(rank=rank)]).view(1, 16)
    assert in_sequence_order(in_rank_order, shard, dim=1).tolist() == [list(range(16))]


class _DropoutAttention(torch.nn.Module):
    """Causal self-attention over embedded tokens, with attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        q = x.view(*x.shape[:2], 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True).sum()


@pytest.mark.usefixtures("fresh_dynamo")
def test_attention_dropout_under_ring_attention_is_refused_by_the_analysis() -> None:
    # sp=8 = Ulysses 4 x ring 2: refused before any rewrite, with the user's source line
    tags = SequenceTags()
    batch, sequence_shard = shard(global_batch(2, 36), 8, 1, tags, ring_degree=2, ring_layout="zigzag")
    torch.manual_seed(0)
    captured = capture(_DropoutAttention(), batch)
    ctx = SPContext(sequence_shard, GROUP, ulysses_group_name="ulysses_group", ring_group_name="ring_group")
    with pytest.raises(NotImplementedError) as error:
        sequence_parallel_pass(captured.gm, captured.example_inputs, ctx, tags)
    message = str(error.value)
    assert "attention dropout (dropout_p=0.1), which ring attention does not support" in message
    assert "test_ring.py" in message and "scaled_dot_product_attention" in message
