"""Attention's backward fed its output's row sums (Note [Attention output by its row sums]).

The kernel property the rewrite rests on (the CPU flash backward reads ``out`` only through
rowsum(grad_out * out)), then the rewrite end to end: both ranks' graphs through the backend with SAC,
against one device, and what it removes from the saved set.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import grad_rel_err, rel_err
from lightning_autosp.compiler.partition import row_sums, sac
from tests.distributed.modules import VOCAB, GPTModule, LlamaModule
from tests.unit.sp_graphs import simulate_compiled_step, single_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

WORLD = 2


def _stand_in(grad_out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """O' of the Note, written out: rowsum(grad_out * O') = delta."""
    grad = grad_out.float()
    largest = grad.abs().amax(-1, keepdim=True)
    scale = torch.where(largest > 0, largest, 1.0)
    unit = grad / scale
    weight = torch.where(largest > 0, delta[..., None] / (scale * (unit * unit).sum(-1, keepdim=True)), 0.0)
    return (unit * weight).to(grad_out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_backward_reads_its_output_only_through_row_sums(dtype, causal) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(2, 3, 37, 16, generator=generator).to(dtype) for _ in range(4))
    grad_out[0, 0, :5] = 0  # rows whose gradient is zero
    grad_out[1, 2, 7] *= 1e-30  # and tiny
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = forward(q, k, v, 0.0, causal)[:2]
    expected = backward(grad_out, q, k, v, out, lse, 0.0, causal)
    delta = (grad_out.float() * out.float()).sum(-1)
    got = backward(grad_out, q, k, v, _stand_in(grad_out, delta), lse, 0.0, causal)
    # float64 reference: the stand-in may not add more error than the kernel's own
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    reference.backward(grad_out.double())
    for ours, theirs, exact in zip(got, expected, (q64.grad, k64.grad, v64.grad)):
        scale = exact.abs().max()
        if dtype == torch.float32:
            assert ((ours - theirs).abs().max() / scale) <= 1e-6
        else:
            own_error = ((theirs.double() - exact).abs().max() / scale).item()
            assert ((ours.double() - exact).abs().max() / scale) <= 1.5 * own_error + 1e-3


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs it)"
)
@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_attention_backwards_read_their_output_only_through_row_sums(kernel) -> None:
    """The CUDA kernels in ``row_sums._OUTPUT_ARGUMENT`` (FlashAttention-2, memory-efficient)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    q, k, v, grad_out = (
        torch.randn(2, 4, 300, 64, device="cuda", generator=generator, dtype=dtype) for _ in range(4)
    )
    aten = torch.ops.aten
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True
        )
        run = lambda o: aten._scaled_dot_product_flash_attention_backward(  # noqa: E731
            grad_out, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset
        )
    else:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        run = lambda o: aten._scaled_dot_product_efficient_attention_backward(  # noqa: E731
            grad_out, q, k, v, None, o, lse, seed, offset, 0.0, [True, True, True, False], True
        )
    delta = (grad_out.float() * out.float()).sum(-1)
    for ours, theirs in zip(run(_stand_in(grad_out, delta)), run(out)):
        if theirs is None:
            continue
        error = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
        assert error <= (1e-5 if dtype == torch.float32 else 2e-2), error


def _run(family: str, global_len: int, compiler: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    module = (GPTModule if family == "gpt" else LlamaModule)().to(dtype)
    generator = torch.Generator().manual_seed(global_len)
    batch = {"input_ids": torch.randint(0, VOCAB, (2, global_len), generator=generator)}
    return module, batch, simulate_compiled_step(module, batch, WORLD, compiler=compiler, sac=True)


@pytest.fixture
def sac_reports(monkeypatch):
    reports = []
    summarize = sac.summarize_partition

    def recording(*args, **kwargs):
        reports.append(summarize(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(sac, "summarize_partition", recording)
    return reports


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("global_len", [16, 15])
def test_rewritten_step_matches_one_device(family, global_len, sac_reports) -> None:
    module, batch, simulated = _run(family, global_len, "aot_eager")
    loss, grads = single_device(module, batch)
    assert all(rel_err(rank_loss, loss) <= 1e-5 for rank_loss in simulated.losses)
    assert grad_rel_err(simulated.grads, grads) <= 1e-4
    assert [r.attention_outputs_by_row_sums for r in sac_reports] == [2] * WORLD  # both layers, each rank


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_head_layout_output_leaves_the_saved_set(family, sac_reports, monkeypatch) -> None:
    """Saved bytes drop by exactly attention's output in the head layout, [B, H/P, S, D] per layer."""
    _run(family, 16, "aot_eager")
    with_row_sums = [r.saved_bytes for r in sac_reports]
    sac_reports.clear()
    monkeypatch.setattr(row_sums, "hand_attention_output_by_row_sums", lambda joint: 0)
    _run(family, 16, "aot_eager")
    without = [r.saved_bytes for r in sac_reports]
    out_bytes = 2 * 16 * 32 // WORLD * 4  # batch 2, 16 tokens, H/P heads of hidden 32, float32
    assert [a - b for a, b in zip(without, with_row_sums)] == [2 * out_bytes] * WORLD


def test_bfloat16_sums_cross_the_all_to_all_as_raw_bytes(sac_reports, monkeypatch) -> None:
    """A bfloat16 model: the float32 sums travel as two bfloat16 columns each and arrive unrounded, so
    the gradients are the ones without the rewrite up to the stand-in's one rounding."""
    _, _, rewritten = _run("llama", 15, "aot_eager", torch.bfloat16)
    assert [r.attention_outputs_by_row_sums for r in sac_reports] == [2] * WORLD
    monkeypatch.setattr(row_sums, "hand_attention_output_by_row_sums", lambda joint: 0)
    _, _, plain = _run("llama", 15, "aot_eager", torch.bfloat16)
    assert all(rel_err(a, b) <= 1e-2 for a, b in zip(rewritten.losses, plain.losses))
    assert grad_rel_err(rewritten.grads, plain.grads) <= 3e-2
