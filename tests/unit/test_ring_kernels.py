"""The kernels of ring attention blocks (``compiler/runtime/ring_kernels.py``), on the CPU.

The CUDA kernels cannot run here. Their code paths are checked in two ways: against the real aten ops'
meta kernels (argument order, types and output shapes: what the CUDA build dispatches to), and for
numbers against the dense reference, with the CUDA ops replaced by CPU stand-ins that keep the CUDA
ops' contracts and assert the inputs those require (``CudaOpsOnCpu`` below: head dims padded to a
multiple of 8, equal heads for the efficient kernel, its lse padded to 32 queries, contiguous fp32 lse
for the flash backward). What they cannot show, the kernels' own numbers on a GPU, is what
``benchmarks/gpu_check.sh`` (``python -m benchmarks.ring_kernels``) measures.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_autosp.compiler.runtime import ring, ring_kernels
from lightning_autosp.compiler.runtime.ring import ring_args
from lightning_autosp.compiler.runtime.ring_kernels import (
    KERNELS,
    choose_kernel,
    cuda_kernel,
    dense_attention,
    dense_attention_backward,
)
from lightning_autosp.data import SequenceShard
from tests.unit.sp_graphs import run_ranks

aten = torch.ops.aten
ops = torch.ops.autosp


def _cpu_flash(query, key, value, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


def _cpu_flash_backward(grad_out, query, key, value, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, causal, scale=scale
    )


def _check_cuda_layout(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.shape[-1] % 8 == 0, "head dim not padded to a multiple of 8"
        assert tensor.stride(-1) == 1, "last dim not contiguous"


class CudaOpsOnCpu:
    """``torch.ops.aten`` with the four CUDA attention ops replaced by CPU stand-ins of their contracts."""

    def __getattr__(self, name: str):
        return getattr(aten, name)

    @staticmethod
    def _scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, debug_mask, *, scale):
        assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
        assert query.shape[1] % key.shape[1] == 0 and (dropout_p, debug_mask) == (0.0, False)
        _check_cuda_layout(query, key, value)
        out, lse = _cpu_flash(query, key, value, is_causal, scale)
        rng_state = torch.zeros(2, dtype=torch.uint64)
        return out, lse, None, None, query.shape[2], key.shape[2], rng_state, rng_state[0], None

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *rng, scale
    ):
        assert (cum_q, cum_k, max_q, max_k) == (None, None, query.shape[2], key.shape[2])
        assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == query.shape[:3]
        assert grad_out.dtype == out.dtype == query.dtype and len(rng) == 2
        _check_cuda_layout(grad_out, query, key, value, out)
        return _cpu_flash_backward(grad_out, query, key, value, out, lse, is_causal, scale)

    @staticmethod
    def _scaled_dot_product_efficient_attention(
        query, key, value, bias, compute_lse, dropout_p, causal, *, scale
    ):
        assert query.shape[1] == key.shape[1] == value.shape[1], "the efficient kernel needs equal heads"
        assert bias is None and compute_lse and dropout_p == 0.0
        _check_cuda_layout(query, key, value)
        out, lse = _cpu_flash(query, key, value, causal, scale)
        padded = lse.new_full((*lse.shape[:2], math.ceil(lse.shape[2] / 32) * 32), math.nan)
        padded[..., : lse.shape[2]] = lse  # what lies past the queries is not theirs
        return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, bias, out, lse, seed, offset, dropout_p, grad_mask, causal, *, scale
    ):
        assert query.shape[1] == key.shape[1] == value.shape[1] and bias is None
        assert (
            lse.is_contiguous() and lse.shape == query.shape[:3] and list(grad_mask) == [True] * 3 + [False]
        )
        _check_cuda_layout(grad_out, query, key, value, out)
        return (*_cpu_flash_backward(grad_out, query, key, value, out, lse, causal, scale), None)


@pytest.fixture
def cuda_ops_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_kernels, "aten", CudaOpsOnCpu())


def _qkv(q_len: int, kv_len: int, dtype: torch.dtype, head_dim: int = 12) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(q_len * 100 + kv_len)
    shapes = [(2, 4, q_len, head_dim), (2, 2, kv_len, head_dim), (2, 2, kv_len, head_dim)]  # GQA
    return [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_cuda_kernels_call_the_aten_ops_as_their_schemas_and_meta_kernels_say(kernel: str) -> None:
    # The real aten ops on meta tensors: argument order and types, and the shapes that come back
    # (the efficient kernel's lse is padded to 64 queries here, and sliced back to 37).
    query, key, value = (t.to("meta") for t in _qkv(37, 37, torch.bfloat16))
    out, lse = KERNELS[kernel].forward(query, key, value, True, 0.3)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
        query.shape,
        query.dtype,
        query.shape[:3],
        torch.float32,
    )
    grads = KERNELS[kernel].backward(torch.empty_like(out), query, key, value, out, lse, True, 0.3)
    assert [g.shape for g in grads] == [query.shape, key.shape, value.shape]


@pytest.mark.usefixtures("cuda_ops_on_cpu")
@pytest.mark.parametrize(
    ("kernel", "dtype", "tolerance"),
    [
        ("cpu_flash", torch.float32, 1e-5),
        ("cuda_efficient", torch.float32, 1e-5),
        ("cuda_efficient", torch.bfloat16, 3e-2),
        ("cuda_flash", torch.bfloat16, 3e-2),
        ("cuda_flash", torch.float16, 5e-3),
    ],
)
@pytest.mark.parametrize(("q_len", "kv_len", "causal"), [(37, 37, True), (21, 37, False)])
def test_kernel_blocks_equal_the_dense_fp32_block(kernel, dtype, tolerance, q_len, kv_len, causal) -> None:
    query, key, value = _qkv(q_len, kv_len, dtype)
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    exact = [t.double() for t in (query, key, value)]
    expected_out, expected_lse = dense_attention(*exact, mask, None)
    out, lse = KERNELS[kernel].forward(query, key, value, causal, query.shape[-1] ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=tolerance, atol=tolerance)

    # backward from the block's final output and lse (here the block is the whole attention)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = dense_attention_backward(grad_out.double(), *exact, expected_out, expected_lse, mask, None)
    final_out = expected_out.to(dtype)
    grads = KERNELS[kernel].backward(
        grad_out, query, key, value, final_out, expected_lse.float(), causal, query.shape[-1] ** -0.5
    )
    for grad, reference, name in zip(grads, expected, ("dq", "dk", "dv")):
        assert grad.shape == reference.shape, name
        scale = reference.abs().max()
        torch.testing.assert_close(grad.double() / scale, reference / scale, rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("cuda_ops_on_cpu")
@pytest.mark.parametrize(
    ("kernel", "dtype", "tolerance"),
    [("cuda_efficient", torch.float32, 1e-5), ("cuda_flash", torch.bfloat16, 3e-2)],
)
def test_ring_attention_on_the_cuda_kernel_paths_matches_sdpa(monkeypatch, kernel, dtype, tolerance) -> None:
    # 3 ring ranks, zigzag (full and causal-diagonal blocks of uneven lengths), GQA, head dim 12
    chosen = []
    monkeypatch.setattr(
        ring, "choose_kernel", lambda masked, query, value: chosen.append(kernel) or (kernel, None)
    )
    global_len, ring_degree = 40, 3
    full = [t.requires_grad_() for t in _qkv(global_len, global_len, dtype)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected_grads = torch.autograd.grad(expected, full, grad_out)
    shards = [
        SequenceShard.for_ring(global_len, ring_degree, r, ring_degree, "zigzag") for r in range(ring_degree)
    ]

    def rank_fn(rank: int):
        index = torch.tensor(shards[rank].positions())
        local = [t.detach()[:, :, index].requires_grad_() for t in full]
        out, _ = ops.ring_attention(*local, None, True, None, *ring_args(shards[rank])[:2], rank, "sim")
        return index, out.detach(), torch.autograd.grad(out, local, grad_out[:, :, index])

    results, _ = run_ranks(ring_degree, rank_fn)
    key_grads = [torch.zeros_like(t) for t in full[1:]]

    def close(actual, reference):
        scale = reference.abs().max()
        torch.testing.assert_close(
            actual.float() / scale, reference.float() / scale, rtol=tolerance, atol=tolerance
        )

    for index, out, (grad_q, grad_k, grad_v) in results:
        close(out, expected.detach()[:, :, index])
        close(grad_q, expected_grads[0][:, :, index])
        key_grads[0][:, :, index] = grad_k
        key_grads[1][:, :, index] = grad_v
    close(key_grads[0], expected_grads[1])
    close(key_grads[1], expected_grads[2])
    assert len(chosen) > 2 * ring_degree  # every block of forward and backward went through the kernel


def test_kernel_choice_by_device_dtype_and_shape() -> None:
    h100 = {"capability": (9, 0), "flash_enabled": True, "efficient_enabled": True}
    assert cuda_kernel(torch.bfloat16, 128, 128, **h100) == ("cuda_flash", None)
    assert cuda_kernel(torch.float16, 12, 12, **h100) == ("cuda_flash", None)  # padded to 16
    assert cuda_kernel(torch.float32, 128, 128, **h100) == ("cuda_efficient", None)
    assert cuda_kernel(torch.bfloat16, 128, 128, **{**h100, "capability": (7, 5)})[0] == "cuda_efficient"
    assert cuda_kernel(torch.bfloat16, 128, 128, **{**h100, "flash_enabled": False})[0] == "cuda_efficient"
    for kwargs, reason in [
        ({"dtype": torch.float64}, "no enabled CUDA attention kernel takes torch.float64"),
        ({"head_dim": 320, "value_head_dim": 320}, "head dim 320 is over"),
        ({"value_head_dim": 64}, r"value head dim \(64\) differs"),
    ]:
        args = {"dtype": torch.bfloat16, "head_dim": 128, "value_head_dim": 128, **kwargs}
        name, why = cuda_kernel(**args, **h100)
        assert name == "dense" and re.search(reason, why), why
    query = torch.empty(1, 2, 4, 8)
    assert choose_kernel(False, query, query) == ("cpu_flash", None)
    assert choose_kernel(True, query, query)[0] == "dense"
    meta = query.to("meta")
    assert choose_kernel(False, meta, meta) == (
        "dense",
        "no flash attention kernel is wired for meta devices",
    )


def test_a_dense_fallback_is_warned_once_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_kernels, "_warned", set())
    query, key, value = _qkv(8, 8, torch.float32)
    args = (query, key, value, torch.ones(8, 8, dtype=torch.bool).tril(), False, None, [0, 8], [1], 0, "sim")
    with pytest.warns(UserWarning, match="dense fp32 score matrices.*explicit attn_mask"):
        run_ranks(1, lambda rank: ops.ring_attention(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a second time
        run_ranks(1, lambda rank: ops.ring_attention(*args))
