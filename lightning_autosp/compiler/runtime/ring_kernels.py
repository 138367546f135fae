"""One ring attention block (Note [Ring attention blocks] in ``ring.py``) on aten's attention kernels.

Note [Ring block kernels]
    A ring block is one attention call: the ring merges its output by its log-sum-exp (lse) in fp32, and
    its backward is computed from the *final* output and lse of its queries (P = exp(scores - lse),
    dS = P * (dP - rowsum(dO * O))), which is how flash attention's backward kernels work anyway. aten
    has such kernels on each device, and none of them holds a [Lq, Lk] score matrix:

    ====== ===================================================== ================ ===================
    device kernel (and its ``_backward``)                        dtypes           K/V heads
    ====== ===================================================== ================ ===================
    cpu    ``_scaled_dot_product_flash_attention_for_cpu``       floating         fewer (GQA) is fine
    cuda   ``_scaled_dot_product_flash_attention`` (sm80+)       fp16, bf16       fewer (GQA) is fine
    cuda   ``_scaled_dot_product_efficient_attention``           fp16, bf16, fp32 repeated to q's
    ====== ===================================================== ================ ===================

    All take [B, H, L, D] with a contiguous last dimension. Their CUDA constraints, handled here:
    the head dim is zero-padded to a multiple of 8 (zeros change no score; the padded output columns
    are dropped; the flash backward refuses other sizes) and the softmax scale is computed from the
    unpadded dim, as SDPA does when it pads; the efficient kernel returns its lse padded to a multiple
    of 32 queries (sliced here) and reads the one it is given by strides (so an unpadded contiguous
    [B, H, Lq] is passed back); the flash backward reads the lse as a contiguous fp32 [B, H, Lq]. Causal
    blocks are diagonal (q and K/V cover the same global range, Lq == Lk), where the kernels' top-left
    (efficient) and bottom-right (flash) causal alignments agree: no offset is needed. Dropout is 0, so
    the random-state inputs of the backward kernels are placeholders they do not read.

    A block that no kernel can take runs as exact fp32 math, one [Lq, Lk] score matrix per head, and
    the reason is warned once per process: an explicit ``attn_mask`` (cut per block: a query may see no
    key of a block, lse -inf, which these kernels do not report), a value head dim unlike the query's,
    a head dim over 256, fp64 on CUDA, flash and efficient SDPA both switched off
    (``torch.backends.cuda``), or a device with no kernel wired here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten
KernelName = Literal["cpu_flash", "cuda_flash", "cuda_efficient", "dense"]
_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256  # the CUDA kernels' limit (flash backward), after padding


@dataclass(frozen=True)
class BlockKernel:
    """Forward: (query, key, value, is_causal, scale) -> (out in query's dtype, lse fp32 [B, H, Lq]).
    Backward: (grad_out, query, key, value, out, lse, is_causal, scale) -> (dq, dk, dv)."""

    forward: Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, ...]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs, log-sum-exps and gradients accumulate in fp32 (fp64 for fp64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_scale(query: Tensor, scale: float | None) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def choose_kernel(masked: bool, query: Tensor, value: Tensor) -> tuple[KernelName, str | None]:
    """The kernel for a block, and why it is "dense" when it is (Note [Ring block kernels])."""
    if masked:
        return "dense", "an explicit attn_mask is cut per block, and the flash kernels take no mask"
    device = query.device.type
    if device == "cpu":
        return "cpu_flash", None
    if device != "cuda":
        return "dense", f"no flash attention kernel is wired for {device} devices"
    return cuda_kernel(
        query.dtype,
        query.shape[-1],
        value.shape[-1],
        capability=torch.cuda.get_device_capability(query.device),
        flash_enabled=torch.backends.cuda.flash_sdp_enabled(),
        efficient_enabled=torch.backends.cuda.mem_efficient_sdp_enabled(),
    )


def cuda_kernel(
    dtype: torch.dtype,
    head_dim: int,
    value_head_dim: int,
    *,
    capability: tuple[int, int],
    flash_enabled: bool,
    efficient_enabled: bool,
) -> tuple[KernelName, str | None]:
    """The CUDA kernel for a block of these inputs: flash for fp16/bf16 on sm80+, else efficient."""
    if value_head_dim != head_dim:
        return "dense", f"the value head dim ({value_head_dim}) differs from the query's ({head_dim})"
    if _padded_dim(head_dim) > _MAX_HEAD_DIM:
        return "dense", f"head dim {head_dim} is over the CUDA kernels' {_MAX_HEAD_DIM}"
    if dtype in _HALF and capability >= (8, 0) and flash_enabled:
        return "cuda_flash", None
    if dtype in (*_HALF, torch.float32) and efficient_enabled:
        return "cuda_efficient", None
    return "dense", (
        f"no enabled CUDA attention kernel takes {dtype} (flash: fp16/bf16 on sm80+, efficient: "
        "fp16/bf16/fp32; torch.backends.cuda.enable_flash_sdp / enable_mem_efficient_sdp)"
    )


_warned: set[str] = set()


def warn_dense_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"Ring attention computes some blocks as dense fp32 score matrices ([L_q, L_k] per head): "
            f"{reason}.",
            stacklevel=3,
        )


# --------------------------------------------------------------------------------------------------
# the kernels


def _cpu_flash_forward(query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float) -> tuple:
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


def _cpu_flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float) -> tuple:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, causal, scale=scale
    )


def _padded_dim(head_dim: int) -> int:
    return math.ceil(head_dim / 8) * 8


def _pad_head_dim(tensor: Tensor) -> Tensor:
    """Zero-pad the last dim to a multiple of 8, contiguous (the CUDA kernels' layout)."""
    pad = _padded_dim(tensor.shape[-1]) - tensor.shape[-1]
    return (F.pad(tensor, (0, pad)) if pad else tensor).contiguous()


def _cuda_flash_forward(query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float) -> tuple:
    q, k, v = (_pad_head_dim(t) for t in (query, key, value))
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[..., : query.shape[-1]], lse


def _cuda_flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float) -> tuple:
    head_dim = query.shape[-1]
    g, q, k, v, o = (_pad_head_dim(t) for t in (grad_out, query, key, value, out))
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)  # read only with dropout
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    grads = aten._scaled_dot_product_flash_attention_backward(
        g, q, k, v, o, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        rng_state, unused, scale=scale,
    )  # fmt: skip
    return tuple(grad[..., :head_dim] for grad in grads)


def expand_heads(kv: Tensor, heads: int) -> Tensor:
    """GQA: K/V head j serves q heads j*g .. (j+1)*g - 1, as SDPA's ``enable_gqa``."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def reduce_heads(grad: Tensor, kv_heads: int) -> Tensor:
    """The gradient of :func:`expand_heads`."""
    if grad.shape[1] == kv_heads:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)


def _cuda_efficient_forward(query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float) -> tuple:
    heads = query.shape[1]
    q, k, v = (_pad_head_dim(t) for t in (query, expand_heads(key, heads), expand_heads(value, heads)))
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out[..., : query.shape[-1]], lse[..., : query.shape[2]]


def _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float) -> tuple:
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    g, q, k, v, o = (
        _pad_head_dim(t) for t in (grad_out, query, expand_heads(key, heads), expand_heads(value, heads), out)
    )
    seed = torch.zeros((), dtype=torch.int64, device=query.device)  # read only with dropout
    offset = torch.zeros((), dtype=torch.int64, device=query.device)
    grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, o, lse.float().contiguous(), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return (
        grad_q[..., :head_dim],
        reduce_heads(grad_k[..., :head_dim], kv_heads),
        reduce_heads(grad_v[..., :head_dim], kv_heads),
    )


KERNELS: dict[KernelName, BlockKernel] = {
    "cpu_flash": BlockKernel(_cpu_flash_forward, _cpu_flash_backward),
    "cuda_flash": BlockKernel(_cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": BlockKernel(_cuda_efficient_forward, _cuda_efficient_backward),
}


# --------------------------------------------------------------------------------------------------
# exact fp32 math, for what no kernel takes


def _finite(lse: Tensor) -> Tensor:
    """-inf (a query that sees no key) -> 0, so exp(scores - lse) gives 0 there, not NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _masked_scores(query: Tensor, key: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """fp32 scores [B, H, Lq, Lk] with -inf where the mask hides a key."""
    dtype = accumulation_dtype(query.dtype)
    keys = expand_heads(key, query.shape[1]).to(dtype)
    scores = query.to(dtype) @ keys.transpose(-1, -2) * softmax_scale(query, scale)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(dtype)


def dense_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp), both fp32; a query that sees no key gets lse -inf and output 0."""
    scores = _masked_scores(query, key, mask, scale)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return probs @ expand_heads(value, query.shape[1]).to(probs.dtype), lse


def dense_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in fp32, from the final output and log-sum-exp of the block's queries."""
    heads, kv_heads = query.shape[1], key.shape[1]
    probs = torch.exp(_masked_scores(query, key, mask, scale) - _finite(lse)[..., None])
    dtype = probs.dtype
    grad = grad_out.to(dtype)
    grad_value = probs.transpose(-1, -2) @ grad
    grad_probs = grad @ expand_heads(value, heads).to(dtype).transpose(-1, -2)
    row_term = (grad * out.to(dtype)).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_term) * softmax_scale(query, scale)
    grad_query = grad_scores @ expand_heads(key, heads).to(dtype)
    grad_key = grad_scores.transpose(-1, -2) @ query.to(dtype)
    return grad_query, reduce_heads(grad_key, kv_heads), reduce_heads(grad_value, kv_heads)
