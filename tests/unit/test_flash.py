"""flash-attn calls rewritten by the SP pass: graphs per rank, numbers with the ranks as threads.

flash-attn builds with CUDA only, so its four torch.library ops get CPU kernels from
``tests/flash_stand_in.py`` (under flash-attn 2.8's names and schemas); the graphs Dynamo traces are
the ones it traces with the real package. ``test_real_flash_attn_on_gpu`` runs the real kernels.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.partition.sac import SequenceAwarePartitioner, node_flops
from lightning_autosp.compiler.prove.flash import bind_op, find_flash_attention
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.sp_pass import SPContext, sequence_parallel_pass
from lightning_autosp.data import SequenceShard
from tests.distributed.attention_modules import FlashGPT, FlashGPTModule, packed_inputs
from tests.distributed.modules import VOCAB
from tests.flash_stand_in import (
    flash_attn_func,
    flash_attn_is_installed,
    flash_attn_stand_in,
    flash_attn_varlen_func,
)
from tests.unit.sp_graphs import (
    GROUP,
    HEAD_TO_SEQ,
    SEQ_TO_HEAD,
    capture,
    concrete,
    fake_propagate,
    fake_shape,
    nodes_with_target,
    packed_all_to_all,
    pass_on,
    run_ranks,
    shard,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

APPLY = torch.ops.higher_order.autograd_function_apply


@pytest.fixture(autouse=True)
def flash_ops() -> Iterator[None]:
    with flash_attn_stand_in():
        yield


def tensor_args(apply: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors an autograd_function_apply takes (Dynamo also passes it the sequence length)."""
    return [
        a
        for a in apply.args[2:]
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)
    ]


def make_module(**kwargs) -> FlashGPTModule:
    torch.manual_seed(0)
    return FlashGPTModule(**kwargs)


def make_batch(batch_size: int, global_len: int, documents: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(global_len)
    batch = {"input_ids": torch.randint(0, VOCAB, (batch_size, global_len), generator=generator)}
    if documents:
        packed = packed_inputs(documents)
        batch["position_ids"] = packed["position_ids"].expand(batch_size, -1)
        batch["cu_seqlens"] = packed["cu_seqlens"].expand(batch_size, -1)
    return batch


def rewrite(module: FlashGPTModule, batch: dict, world: int, rank: int, no_grad: bool = False):
    tags = SequenceTags()
    local, sequence_shard = shard(batch, world, rank, tags)
    with torch.set_grad_enabled(not no_grad):
        captured = capture(lambda b: module.training_step(b, 0), local)
    context = SPContext(sequence_shard, GROUP)
    gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, context, tags)
    return gm, report, concrete(captured.example_inputs), sequence_shard


# --------------------------------------------------------------------------------------------------
# graphs


@pytest.mark.parametrize("rank", [1])
def test_flash_attn_func_gets_all_to_alls_on_heads_and_sequence(rank: int) -> None:
    module = make_module(kv_heads=1, window=8, softcap=5.0)
    gm, report, inputs, shard = rewrite(module, make_batch(2, 25), 2, rank)
    applies = nodes_with_target(gm, APPLY)
    assert report.attention == [n.name for n in applies] and len(applies) == 2
    assert report.all_to_alls == 4  # q, k and v in one; the output
    # 1 KV head over sp=2: repeated to 2 on the head dim of [B, S, H, D] before the all-to-all
    assert report.replicated_kv_heads == [f"{n.name}: 1 -> 2" for n in applies]
    assert all(
        n.args[1:] == (2,) and n.kwargs == {"dim": 2} for n in nodes_with_target(gm, torch.repeat_interleave)
    )
    for apply in applies:
        q, k, v = tensor_args(apply)
        packed = [packed_all_to_all(t) for t in (q, k, v)]
        assert packed == [(packed[0][0], index) for index in range(3)]
        assert packed[0][0].args[1:] == (2, 1, [13, 12], rank, GROUP)  # head dim 2, sequence dim 1 (BSHD)
        (output,) = apply.users
        (back,) = output.users
        assert back.target is HEAD_TO_SEQ and back.args == (output, 2, 1, [13, 12], rank, GROUP)

    fake_propagate(gm, inputs)
    for apply in applies:
        q, k, _ = tensor_args(apply)
        assert fake_shape(q) == (2, 25, 2, 8) and fake_shape(k) == (2, 25, 1, 8)
        (output,) = apply.users
        assert fake_shape(output) == (2, 25, 2, 8)
        assert fake_shape(next(iter(output.users))) == (2, shard.local_len, 4, 8)


def test_flash_under_no_grad_rewrites_the_op_itself() -> None:
    gm, report, inputs, _ = rewrite(make_module(), make_batch(2, 24), 2, 1, no_grad=True)
    ops = [m.op for m in find_flash_attention(gm)]
    assert len(ops) == 2 and nodes_with_target(gm, APPLY) == []
    assert report.attention == [op.name for op in ops]
    assert all(packed_all_to_all(op.args[0])[1] == 0 for op in ops)
    fake_propagate(gm, inputs)
    assert all(fake_shape(op.args[0]) == (2, 24, 2, 8) for op in ops)


@pytest.mark.parametrize("rank", [1])
def test_flash_varlen_on_one_packed_row(rank: int) -> None:
    gm, report, inputs, shard = rewrite(make_module(varlen=True), make_batch(1, 25, (7, 11, 7)), 2, rank)
    matches = find_flash_attention(gm)
    assert len(matches) == 2 and report.all_to_alls == 4
    for match in matches:
        assert match.layout == "SHD"
        packed, _ = packed_all_to_all(match.operands["q"])
        assert packed.args[1:] == (1, 0, [13, 12], rank, GROUP)  # [T, H, D]
        # the row's cu_seqlens come from the batch as they are: not sharded, not exchanged
        assert match.operands["cu_seqlens_q"].target is not SEQ_TO_HEAD
        # max_seqlen=T was the local length; the whole row's documents can be up to S long
        backward = getattr(gm, match.node.args[1].target)
        (backward_op,) = [n for n in backward.graph.nodes if "varlen_backward" in str(n.target)]
        for op in (match.op, backward_op):
            assert (bind_op(op)["max_seqlen_q"], bind_op(op)["max_seqlen_k"]) == (25, 25)
    fake_propagate(gm, inputs)
    assert fake_shape(matches[0].operands["q"]) == (25, 2, 8)


# --------------------------------------------------------------------------------------------------
# numbers: every rank's loss and the mean of the ranks' gradients equal one device's


def simulate(module: FlashGPTModule, batch: dict, world: int) -> None:
    params = list(module.parameters())
    expected = module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    graphs = [rewrite(module, batch, world, rank) for rank in range(world)]

    def rank_fn(rank: int):
        gm, _, inputs, _ = graphs[rank]
        (loss,) = gm(*inputs)
        return loss.detach(), torch.autograd.grad(loss, params)

    results, comm = run_ranks(world, rank_fn)
    assert all(calls == comm.calls[0] for calls in comm.calls)
    for loss, _ in results:
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for index, expected_grad in enumerate(expected_grads):
        mean = torch.stack([grads[index] for _, grads in results]).mean(0)
        torch.testing.assert_close(mean, expected_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "batch_size", "global_len", "documents", "world"),
    [
        # 1 KV head repeated to 4, sliding window, softcap, head dim 4 (padded to 8 by the Function);
        # shards 7 + 7 + 6 + 6 (sp=2 runs in the parity tests)
        ({"dim": 16, "kv_heads": 1, "window": 8, "softcap": 5.0}, 2, 26, (), 4),
        ({"varlen": True}, 1, 26, (5, 13, 8), 4),  # 2 KV heads repeated to 4; a document over 3 ranks
    ],
)
def test_training_step_matches_single_device(kwargs, batch_size, global_len, documents, world) -> None:
    simulate(make_module(**kwargs), make_batch(batch_size, global_len, documents), world)


class RecordingPartitioner(SequenceAwarePartitioner):
    def __call__(self, gm, joint_inputs, **kwargs):
        self.joint = gm
        return super().__call__(gm, joint_inputs, **kwargs)


def test_sac_saves_flash_attention() -> None:
    """AOTAutograd takes flash-attn's Function apart; SAC keeps its forward saved, never recomputed."""
    module, batch = make_module(kv_heads=1), make_batch(2, 12)
    params = list(module.parameters())
    expected = module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    backend = AutoSPBackend(None, compiler="aot_eager", sac=True)
    backend.partitioner = partitioner = RecordingPartitioner()
    loss = torch.compile(lambda b: module.training_step(b, 0), backend=backend, dynamic=False)(batch)
    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(torch.autograd.grad(loss, params), expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    forward = [n for n in partitioner.joint.graph.nodes if "_flash_attn_forward" in str(n.target)]
    assert len(forward) == 2
    assert all(n.meta["recompute"] == CheckpointPolicy.MUST_SAVE for n in forward)
    assert node_flops(forward[0]) == 4 * 2 * 4 * 12 * 12 * 8  # 4 * B * H * S * S * D


# --------------------------------------------------------------------------------------------------
# refusals, before any collective


def test_alibi_is_refused() -> None:
    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(4))

    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        pass_on(
            attention, SequenceShard.balanced(12, 2, 0), q, q.clone(), q.clone(), sharded={0: 1, 1: 1, 2: 1}
        )


def test_varlen_over_a_flattened_batch_is_refused() -> None:
    model = FlashGPT(varlen=True)

    def step(ids):
        B, T = ids.shape
        x = model.wte(ids)
        q = model.q[0](x).view(B * T, 4, 8)  # two rows flattened into one varlen sequence
        k, v = model.kv[0](x).view(B * T, 2, 2, 8).unbind(1)
        cu = torch.tensor([0, T, 2 * T], dtype=torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu.clone(), T, T, causal=True).sum()

    with pytest.raises(NotImplementedError, match="batch size 1"):
        pass_on(step, SequenceShard.balanced(12, 2, 0), torch.zeros(2, 6, dtype=torch.long), sharded={0: 1})


def test_cu_seqlens_from_the_shard_are_refused() -> None:
    def step(q, k, v, lengths):
        cu = F.pad(lengths.cumsum(-1), (1, 0))[0, :3].to(torch.int32)  # from this rank's tokens
        return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu.clone(), 6, 6, causal=True).sum()

    q = torch.randn(1, 6, 4, 8)
    lengths = torch.full((1, 6), 2)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q is computed from the sequence"):
        pass_on(
            step,
            SequenceShard.balanced(12, 2, 0),
            q,
            q.clone(),
            q.clone(),
            lengths,
            sharded={0: 1, 1: 1, 2: 1, 3: 1},
        )


def test_flex_attention_is_refused() -> None:
    """Not rewritten (yet), so refused: it would attend over this rank's tokens only."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(NotImplementedError, match="flex_attention is not an attention call"):
        pass_on(
            lambda q, k, v: flex_attention(q, k, v),
            SequenceShard.balanced(12, 2, 0),
            q,
            q.clone(),
            q.clone(),
            sharded={0: 2, 1: 2, 2: 2},
        )


def test_heads_not_divisible_by_sp_size() -> None:
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(3\)"):
        pass_on(
            lambda q, k, v: flash_attn_func(q, k, v, causal=True),
            SequenceShard.balanced(8, 2, 0),
            q,
            q.clone(),
            q.clone(),
            sharded={0: 1, 1: 1, 2: 1},
        )


# --------------------------------------------------------------------------------------------------
# the real package


@pytest.mark.skipif(
    not (flash_attn_is_installed() and torch.cuda.is_available()), reason="needs flash-attn and a GPU"
)
def test_real_flash_attn_on_gpu() -> None:
    """flash-attn's own kernels (bf16) under the rewrite, two ranks as threads on one GPU."""
    torch.manual_seed(0)
    module = FlashGPTModule(kv_heads=1, window=64).cuda().to(torch.bfloat16)
    batch = {k: v.cuda() for k, v in make_batch(2, 250).items()}
    params = list(module.parameters())
    expected = module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    graphs = [rewrite(module, batch, 2, rank) for rank in range(2)]
    assert all(report.all_to_alls == 4 for _, report, *_ in graphs)

    def rank_fn(rank: int):
        gm, _, inputs, _ = graphs[rank]
        (loss,) = gm(*inputs)
        return loss.detach().float(), torch.autograd.grad(loss, params)

    results, _ = run_ranks(2, rank_fn)
    for loss, _ in results:  # bf16: 8 bits of mantissa
        torch.testing.assert_close(loss, expected.detach().float(), rtol=1e-2, atol=1e-2)
    for index, expected_grad in enumerate(expected_grads):
        mean = torch.stack([grads[index].float() for _, grads in results]).mean(0)
        torch.testing.assert_close(mean, expected_grad.float(), rtol=5e-2, atol=5e-2)
