"""Chunked LM head + cross-entropy: the op (opcheck, values, gradients, bf16 upcast) and the pass on
traced graphs (GPT and HF Llama, alone and after the SP pass, ranks simulated in threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.lower.chunked_loss import (
    ChunkedLossReport,
    chunked_loss_pass,
    default_chunk_tokens,
    linear_cross_entropy,
    token_chunks,
)
from lightning_autosp.compiler.partition.sac import SequenceAwarePartitioner
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.compiler.sp_pass import SPContext, sequence_parallel_pass
from lightning_autosp.strategy import AutoSPStrategy
from tests.distributed.modules import VOCAB
from tests.unit.sp_graphs import (
    ALL_REDUCE_SUM,
    GROUP,
    capture,
    concrete,
    fake_propagate,
    global_batch,
    module,
    nodes_with_target,
    run_ranks,
    shard,
    training_step,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CHUNKED = torch.ops.autosp_loss.linear_cross_entropy.default


def _inputs(dtype=torch.float64, tokens=23, vocab=11, width=8, bias=True, ignored=(3, 7, 22)):
    generator = torch.Generator().manual_seed(tokens * vocab)
    hidden = torch.randn(tokens, width, dtype=dtype, generator=generator).requires_grad_()
    weight = torch.randn(vocab, width, dtype=dtype, generator=generator).requires_grad_()
    bias_ = torch.randn(vocab, dtype=dtype, generator=generator).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[list(ignored)] = -100
    return hidden, weight, bias_, target


# --------------------------------------------------------------------------------------------------
# the op


@pytest.mark.parametrize(("bias", "reduction"), [(True, "mean"), (False, "sum")])
def test_opcheck(bias: bool, reduction: str) -> None:
    hidden, weight, bias_, target = _inputs(bias=bias)
    torch.library.opcheck(CHUNKED, (hidden, weight, bias_, target, -100, reduction, 5, torch.float64))


@pytest.mark.parametrize("chunk", [1, 5, 23, 1000])
@pytest.mark.parametrize(("bias", "reduction"), [(True, "mean"), (False, "sum"), (True, "sum")])
def test_equals_the_unchunked_loss_and_gradients(chunk: int, bias: bool, reduction: str) -> None:
    hidden, weight, bias_, target = _inputs(torch.float32, bias=bias)
    leaves = [t for t in (hidden, weight, bias_) if t is not None]
    expected = F.cross_entropy(F.linear(hidden, weight, bias_), target, reduction=reduction)
    expected_grads = torch.autograd.grad(expected, leaves)
    loss = linear_cross_entropy(hidden, weight, bias_, target, -100, reduction, chunk, torch.float32)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for grad, expected_grad in zip(torch.autograd.grad(loss, leaves), expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_bf16_logits_are_computed_in_bf16_then_upcast() -> None:
    """As Hugging Face's ``logits.float()``: bf16 matmul, fp32 softmax; not fp32 logits."""
    hidden, weight, _, target = _inputs(torch.float32, tokens=300, vocab=1000, width=64, bias=False)
    hidden, weight = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    upcast = F.cross_entropy(F.linear(hidden, weight).float(), target)
    upcast_grads = torch.autograd.grad(upcast, [hidden, weight])
    loss = linear_cross_entropy(hidden, weight, None, target, -100, "mean", 37, torch.float32)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, upcast, rtol=1e-6, atol=0)
    fp32_logits = F.cross_entropy(F.linear(hidden.float(), weight.float()), target)
    assert abs(loss - fp32_logits) > 10 * abs(loss - upcast)
    grads = torch.autograd.grad(loss, [hidden, weight])
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16]
    for grad, expected in zip(grads, upcast_grads):  # within bf16 rounding (2**-7)
        torch.testing.assert_close(grad.float(), expected.float(), rtol=0, atol=8e-3 * expected.abs().max())


def test_chunks_cover_every_token_once() -> None:
    assert token_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert token_chunks(3, 5) == [(0, 3)]
    assert default_chunk_tokens(128256) == 523  # 2**26 logits
    assert default_chunk_tokens(48) > 1_000_000


# --------------------------------------------------------------------------------------------------
# the pass on traced training steps


def _chunk(gm: fx.GraphModule, chunk_tokens: int | None = 7) -> ChunkedLossReport:
    report = ChunkedLossReport()
    chunked_loss_pass(gm, report, chunk_tokens=chunk_tokens)
    return report


@pytest.mark.parametrize("kind", ["gpt-causal", "llama-kv2"])
def test_single_device_step_is_chunked_and_exact(kind: str) -> None:
    lightning_module = module(kind)
    params = list(lightning_module.parameters())
    batch = global_batch(2, 61, 9)
    expected = lightning_module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)

    captured = capture(training_step(kind), batch)
    report = _chunk(captured.gm)

    (op,) = nodes_with_target(captured.gm, CHUNKED)
    rows, weight, bias, target, ignore_index, reduction, chunk, logits_dtype = op.args
    tokens = 2 * 60 if kind.startswith("gpt") else 2 * 61  # GPT drops the last logit, HF pads the labels
    assert rows.meta["example_value"].shape == (tokens, 32)
    assert (ignore_index, reduction, chunk, logits_dtype) == (-100, "mean", 7, torch.float32)
    assert (bias is None) == kind.startswith("llama")
    assert not nodes_with_target(captured.gm, F.cross_entropy)
    assert not [n for n in nodes_with_target(captured.gm, F.linear) if n.args[1] is weight]  # no LM head left
    assert report.skipped == []
    assert f"{tokens} tokens x {VOCAB} vocab in {-(-tokens // 7)} chunk(s) of 7" in report.chunked[0]
    (loss,) = captured.gm(*captured.example_inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    inputs = [p for p in captured.example_inputs if isinstance(p, torch.nn.Parameter)]
    grads = dict(zip(map(id, inputs), torch.autograd.grad(loss, inputs)))
    for param, expected_grad in zip(params, expected_grads):
        torch.testing.assert_close(grads[id(param)], expected_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(("kind", "global_len", "world"), [("gpt-causal", 26, 4), ("llama-kv2", 61, 2)])
def test_after_the_sp_pass_every_rank_chunks_its_tokens(kind: str, global_len: int, world: int) -> None:
    """SP turns the mean into sum + count + all-reduce; the op replaces the local sum, on uneven shards."""
    lightning_module = module(kind)
    params = list(lightning_module.parameters())
    batch = global_batch(2, global_len, 9)
    expected = lightning_module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    graphs = []
    for rank in range(world):
        tags = SequenceTags()
        local, sequence_shard = shard(batch, world, rank, tags)
        captured = capture(training_step(kind), local)
        context = SPContext(sequence_shard, GROUP)
        gm, _ = sequence_parallel_pass(captured.gm, captured.example_inputs, context, tags)
        report = _chunk(gm, chunk_tokens=5)
        (op,) = nodes_with_target(gm, CHUNKED)
        assert op.args[5] == "sum" and [u.target for u in op.users] == [torch.stack]
        assert nodes_with_target(gm, ALL_REDUCE_SUM) and not nodes_with_target(gm, F.cross_entropy)
        assert len(report.chunked) == 1
        inputs = concrete(captured.example_inputs)
        fake_propagate(gm, inputs)
        graphs.append((gm, inputs))

    def rank_fn(rank: int):
        gm, inputs = graphs[rank]
        (loss,) = gm(*inputs)
        leaves = [p for p in inputs if isinstance(p, torch.nn.Parameter)]
        by_param = {id(p): g for p, g in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True))}
        return loss.detach(), [by_param.get(id(p)) for p in params]

    results, _ = run_ranks(world, rank_fn)
    for loss, _ in results:
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    for index, expected_grad in enumerate(expected_grads):
        mean = torch.stack([grads[index] for _, grads in results]).mean(0)
        torch.testing.assert_close(mean, expected_grad, rtol=1e-4, atol=1e-7)


def test_autocast_head_is_cast_to_bf16_and_the_loss_to_fp32() -> None:
    head = torch.nn.Linear(16, 40)
    x, labels = torch.randn(2, 9, 16), torch.randint(0, 40, (2, 9))
    step = lambda x, labels: F.cross_entropy(head(x).flatten(0, 1), labels.flatten())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = step(x, labels)
        captured = capture(step, x, labels)
    report = _chunk(captured.gm)
    (op,) = nodes_with_target(captured.gm, CHUNKED)
    assert [a.meta["example_value"].dtype for a in op.args[:3]] == [torch.bfloat16] * 3
    assert op.args[-1] == torch.float32 and "logits in bfloat16, upcast to float32" in report.chunked[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss,) = captured.gm(*captured.example_inputs)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_hf_llama_in_bf16_upcasts_like_hf() -> None:
    lightning_module = module("llama-kv2")
    batch = global_batch(2, 24)
    original = {n: p.data for n, p in lightning_module.named_parameters()}
    try:
        for p in lightning_module.parameters():
            p.data = p.data.bfloat16()
        expected = lightning_module.training_step(batch, 0)
        captured = capture(training_step("llama-kv2"), batch)
        report = _chunk(captured.gm)
        (loss,) = captured.gm(*captured.example_inputs)
    finally:
        for n, p in lightning_module.named_parameters():
            p.data = original[n]
    assert "logits in bfloat16, upcast to float32" in report.chunked[0]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------------
# when the logits are needed elsewhere: skipped, with the reason


HEAD = torch.nn.Linear(8, VOCAB)


def _returns_logits(x, labels):
    logits = HEAD(x)
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), logits


def _logs_accuracy(x, labels):
    logits = HEAD(x)
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), accuracy


def _scaled_logits(x, labels):
    return F.cross_entropy((HEAD(x) / 2.0).view(-1, VOCAB), labels.view(-1))


def _smoothed(x, labels):
    return F.cross_entropy(HEAD(x).view(-1, VOCAB), labels.view(-1), label_smoothing=0.1)


def _logits_from_outside(logits, labels):
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


@pytest.mark.parametrize(
    ("step", "reason"),
    [
        (_returns_logits, "also used by the graph output"),
        (_logs_accuracy, "also used by argmax"),
        (_scaled_logits, "is not a row-wise view or cast"),
        (_smoothed, "label smoothing"),
        (_logits_from_outside, "come from outside this graph"),
    ],
)
def test_logits_needed_elsewhere_are_not_chunked_and_the_reason_is_reported(step, reason: str) -> None:
    first = torch.randn(2, 6, VOCAB if step is _logits_from_outside else 8)
    captured = capture(step, first, torch.randint(0, VOCAB, (2, 6)))
    report = _chunk(captured.gm)
    assert report.chunked == [] and not nodes_with_target(captured.gm, CHUNKED)
    (line,) = report.lines()
    assert line.startswith("loss not chunked: cross_entropy: ") and reason in line, line
    assert len(nodes_with_target(captured.gm, F.cross_entropy)) == 1


# --------------------------------------------------------------------------------------------------
# the backend: SAC saves the op's inputs, not logits; the option turns it off


class RecordingPartitioner(SequenceAwarePartitioner):
    """Keeps the partitioned forward and backward graphs."""

    def __call__(self, gm, joint_inputs, **kwargs):
        self.forward, self.backward = super().__call__(gm, joint_inputs, **kwargs)
        (output,) = [n for n in self.forward.graph.nodes if n.op == "output"]
        self.saved = [n for n in output.args[0][kwargs["num_fwd_outputs"] :] if n.op != "placeholder"]
        return self.forward, self.backward


@pytest.mark.parametrize(
    ("chunked_loss", "sac"), [(True, True), (False, True), (True, False), (False, False)]
)
def test_with_sac_no_full_logits_exist_in_forward_or_backward(chunked_loss: bool, sac: bool) -> None:
    lightning_module = module("gpt-causal")
    params = list(lightning_module.parameters())
    batch = global_batch(2, 20)
    expected = lightning_module.training_step(batch, 0)
    expected_grads = torch.autograd.grad(expected, params)
    backend = AutoSPBackend(
        None, compiler="aot_eager", sac=sac, chunked_loss=chunked_loss, loss_chunk_tokens=8
    )
    backend.partitioner = partitioner = RecordingPartitioner("all" if sac else "off")
    loss = torch.compile(training_step("gpt-causal"), backend=backend, dynamic=False)(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for grad, expected_grad in zip(torch.autograd.grad(loss, params), expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)

    tokens = 2 * 19
    full_logits = [
        node.name
        for graph in (partitioner.forward, partitioner.backward)
        for node in graph.graph.nodes
        if node.op == "call_function"
        and isinstance(node.meta.get("val"), torch.Tensor)
        and node.meta["val"].shape[-1:] == (VOCAB,)
        and node.meta["val"].numel() >= tokens * VOCAB
    ]
    saved = [tuple(n.meta["val"].shape) for n in partitioner.saved]
    if chunked_loss:
        assert full_logits == []
        (report,) = backend.loss_reports
        assert f"{tokens} tokens x 48 vocab in 5 chunk(s) of 8" in report.chunked[0]
        if not sac:  # PyTorch's min-cut keeps the op's inputs: the hidden rows and the targets
            assert (tokens, 32) in saved and (tokens,) in saved
    else:
        assert any("log_softmax" in name for name in full_logits) and backend.loss_reports == []
        if not sac:
            assert (tokens, VOCAB) in saved  # log_softmax's output


def test_loss_options_are_checked() -> None:
    with pytest.raises(ValueError, match="loss_chunk_tokens=0 must be a positive number"):
        AutoSPStrategy(loss_chunk_tokens=0)
    with pytest.raises(TypeError, match="chunked_loss='yes' must be True or False"):
        AutoSPBackend(None, chunked_loss="yes")
