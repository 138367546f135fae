"""Every rank's rewritten graph run in one process, ranks as threads, collectives simulated in memory.

``ThreadedComm`` replaces ``torch.distributed`` inside ``lightning_autosp.compiler.runtime.ops`` only, so the
autosp ops, their autograd formulas and the rewritten graphs run unchanged. This checks the numbers
the graph-level tests cannot: each rank's loss is the single-device loss, and the mean of the ranks'
gradients (what DDP computes) is the single-device gradient.
"""

from __future__ import annotations

import pytest
import torch

from lightning_autosp.compiler.runtime.ops import (
    head_to_seq,
    seq_to_head,
    seq_to_head_packed,
    sequence_window,
)
from lightning_autosp.data import SequenceShard
from tests.unit.sp_graphs import ALL_REDUCE_SUM, global_batch, module, rewritten_step, run_ranks

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def shards(global_len: int, world: int) -> list[SequenceShard]:
    return [SequenceShard.balanced(global_len, world, r) for r in range(world)]


# --------------------------------------------------------------------------------------------------
# the ops across ranks


@pytest.mark.parametrize(("layout", "global_len", "world"), [("BHSD", 7, 3), ("BSHD", 7, 3), ("BHSD", 8, 2)])
def test_all_to_all_across_uneven_shards(layout: str, global_len: int, world: int) -> None:
    head_dim, seq_dim = layout.index("H"), layout.index("S")
    heads = 2 * world
    sizes = {"B": 2, "H": heads, "S": global_len, "D": 3}
    full = torch.randn(*(sizes[c] for c in layout))
    weights = torch.randn(*(sizes[c] for c in layout))  # d loss / d seq_to_head output, per head block
    per_rank = heads // world
    parts = shards(global_len, world)

    def rank_fn(rank: int):
        shard = parts[rank]
        x = full.narrow(seq_dim, shard.offset, shard.local_len).clone().requires_grad_()
        args = (head_dim, seq_dim, list(shard.seq_lens), rank, "sim")
        heads_out = seq_to_head(x, *args)
        back = head_to_seq(heads_out, *args)
        (heads_out * weights.narrow(head_dim, rank * per_rank, per_rank)).sum().backward()
        return x, heads_out.detach(), back.detach()

    results, comm = run_ranks(world, rank_fn)
    for rank, (x, heads_out, back) in enumerate(results):
        shard = parts[rank]
        torch.testing.assert_close(
            heads_out, full.narrow(head_dim, rank * per_rank, per_rank), rtol=0, atol=0
        )
        torch.testing.assert_close(back, x.detach(), rtol=0, atol=0)
        # rank r's tokens reach every rank's head block, so their gradient comes from every rank's weights
        expected = weights.narrow(seq_dim, shard.offset, shard.local_len)
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert all(calls == comm.calls[0] for calls in comm.calls)


@pytest.mark.parametrize(("global_len", "world"), [(7, 3), (8, 2)])
def test_q_k_and_v_in_one_all_to_all_are_what_three_would_be(global_len: int, world: int) -> None:
    """Note [One all-to-all for q, k and v]: the packed exchange gives each tensor, and each gradient,
    exactly what its own all-to-all gives (GQA head counts, uneven shards), in one collective."""
    heads = {"q": 2 * world, "k": world, "v": world}
    full = {name: torch.randn(2, count, global_len, 3) for name, count in heads.items()}
    weights = {name: torch.randn(2, count // world, global_len, 3) for name, count in heads.items()}
    parts = shards(global_len, world)

    def rank_fn(rank: int, packed: bool):
        shard = parts[rank]
        xs = [t.narrow(2, shard.offset, shard.local_len).clone().requires_grad_() for t in full.values()]
        args = (1, 2, list(shard.seq_lens), rank, "sim")
        outs = seq_to_head_packed(xs, *args) if packed else [seq_to_head(x, *args) for x in xs]
        sum((out * w).sum() for out, w in zip(outs, weights.values())).backward()
        return [out.detach() for out in outs], [x.grad for x in xs]

    together, comm_together = run_ranks(world, lambda rank: rank_fn(rank, True))
    apart, comm_apart = run_ranks(world, lambda rank: rank_fn(rank, False))
    for (outs, grads), (expected_outs, expected_grads) in zip(together, apart):
        for got, expected in zip(outs + grads, expected_outs + expected_grads):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # forward and backward: one all-to-all each instead of three
    assert [len(calls) for calls in comm_together.calls] == [2] * world
    assert [len(calls) for calls in comm_apart.calls] == [6] * world


@pytest.mark.parametrize(
    ("global_len", "world", "shift"), [(8, 3, 1), (8, 3, 2), (9, 2, 1), (5, 4, 1), (9, 4, 3)]
)
def test_a_slice_reads_its_window_with_its_gradient(global_len: int, world: int, shift: int) -> None:
    """``x[:, shift:]`` of the global sequence, cut at the shard boundaries (Note [Windows of the sequence]):
    rank r's output positions [lo, hi) read rows [lo + shift, hi + shift), a few of them from the next
    ranks (past a 2-token neighbour in (9, 4, 3)), and their gradients return to their owners."""
    full = torch.randn(2, global_len)
    parts = shards(global_len, world)
    out_len = global_len - shift
    owned = parts[0].owned_ranges(out_len)
    starts, stops = [lo + shift for lo, _ in owned], [hi + shift for _, hi in owned]
    weights = [torch.randn(2, hi - lo) for lo, hi in owned]

    def rank_fn(rank: int):
        shard = parts[rank]
        x = full.narrow(1, shard.offset, shard.local_len).clone().requires_grad_()
        out = sequence_window(x, 1, starts, stops, list(shard.seq_lens), rank, "sim")
        (out * weights[rank]).sum().backward()
        return x, out.detach()

    results, comm = run_ranks(world, rank_fn)
    assert all(calls == comm.calls[0] for calls in comm.calls)  # forward and backward, alike on every rank
    expected_grad = torch.zeros_like(full)
    for rank, (_, out) in enumerate(results):
        lo, hi = owned[rank]
        torch.testing.assert_close(out, full[:, shift:][:, lo:hi], rtol=0, atol=0)
        expected_grad[:, shift:][:, lo:hi] += weights[rank]
    for rank, (x, _) in enumerate(results):
        shard = parts[rank]
        torch.testing.assert_close(x.grad, expected_grad[:, shard.offset : shard.offset + shard.local_len])


def test_all_reduce_sum_and_its_gradient() -> None:
    world = 3
    values = torch.randn(world, 4)
    weights = torch.randn(world, 4)

    def rank_fn(rank: int):
        x = values[rank].clone().requires_grad_()
        total = ALL_REDUCE_SUM(x, "sim")
        (total * weights[rank]).sum().backward()
        return total.detach(), x.grad

    results, _ = run_ranks(world, rank_fn)
    for total, grad in results:
        torch.testing.assert_close(total, values.sum(0))
        torch.testing.assert_close(grad, weights.sum(0))  # every rank's objective uses my partial sum


# --------------------------------------------------------------------------------------------------
# whole training steps


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "global_len", "world", "gqa", "ignored_tail"),
    [
        ("gpt-triu", 24, 2, False, 0),
        ("gpt-causal", 61, 2, False, 0),  # uneven shards (31, 30)
        ("gpt-causal", 26, 4, False, 0),  # (7, 7, 6, 6)
        ("gpt-causal", 24, 2, False, 14),  # rank 1 holds no valid label: adds 0 to the loss, not NaN
        ("llama-kv2", 61, 2, False, 0),
        ("llama-kv1", 24, 2, True, 0),  # 1 KV head replicated to 2
        ("llama-kv2", 26, 4, True, 0),  # 2 KV heads replicated to 4
    ],
)
def test_training_step_matches_single_device(kind, global_len, world, gqa, ignored_tail) -> None:
    lightning_module = module(kind)
    params = list(lightning_module.parameters())
    batch = global_batch(2, global_len, ignored_tail)
    expected_loss = lightning_module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected_loss, params)
    graphs = [
        rewritten_step(kind, global_len, world, rank, gqa=gqa, ignored_tail=ignored_tail)
        for rank in range(world)
    ]

    def rank_fn(rank: int):
        rewritten = graphs[rank]
        (loss,) = rewritten.gm(*rewritten.example_inputs)
        inputs = [p for p in rewritten.example_inputs if isinstance(p, torch.nn.Parameter)]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        by_param = {id(p): g for p, g in zip(inputs, grads) if g is not None}
        return loss.detach(), [by_param.get(id(p), torch.zeros_like(p)) for p in params]

    results, comm = run_ranks(world, rank_fn)
    assert all(calls == comm.calls[0] for calls in comm.calls)
    for loss, _ in results:
        torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    names = [name for name, _ in lightning_module.named_parameters()]
    for index, name in enumerate(names):
        mean = torch.stack([grads[index] for _, grads in results]).mean(0)
        torch.testing.assert_close(
            mean, expected_grads[index], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
