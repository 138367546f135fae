"""A CPU stand-in for flash-attn 2.x's torch.library ops, for tests: flash-attn only builds with CUDA.

``flash_attn_stand_in()`` defines ``flash_attn::_flash_attn_forward``, ``_flash_attn_backward`` and
their varlen pair in a scoped ``torch.library`` fragment, with the schemas flash-attn 2.8 registers
(``torch.library.custom_op`` on its Python functions), computes them on CPU with plain attention
math, and removes them on exit. ``flash_attn_func`` / ``flash_attn_varlen_func`` below have
flash-attn's signatures and call the ops from an ``autograd.Function``, as flash-attn's own do, so
Dynamo sees what it sees with the real package: an ``autograd_function_apply`` whose forward body
calls ``flash_attn::_flash_attn_forward`` (or the op itself under ``no_grad``).

Where flash-attn is installed, ``flash_attn_func`` is flash-attn's own, and the stand-in only adds
the CPU kernels to its ops (which have CUDA kernels only) for the duration of the block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, "
    "SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, "
    "bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a6!)? dq, "
    "Tensor(a7!)? dk, Tensor(a8!)? dv, float dropout_p, float softmax_scale, bool causal, "
    "SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, "
    "bool deterministic, Tensor? rng_state=None) -> Tensor"
)
VARLEN_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left=-1, "
    "SymInt window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool return_softmax=False, "
    "Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, bool zero_tensors=False, "
    "SymInt num_splits=0) -> (Tensor, Tensor, Tensor, Tensor)"
)
VARLEN_BACKWARD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a6!)? dq, "
    "Tensor(a7!)? dk, Tensor(a8!)? dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, "
    "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
    "Tensor? rng_state=None, bool zero_tensors=False) -> Tensor"
)


def flash_attn_is_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# reference attention with flash-attn 2's options


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """q [B, S_q, H, D], k/v [B, S_k, H_kv, D] -> (out [B, S_q, H, D], logsumexp [B, H, S_q]).

    Query i sees keys j with j <= i + S_k - S_q (causal, aligned bottom-right) and, per side, within
    the window; a query that sees no key gets 0. ALiBi slopes ([H] or [B, H]) add
    -slope * |i + S_k - S_q - j| to the (capped) scores.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    s_q, s_k = q.shape[2], k.shape[2]
    i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        scores = scores - alibi_slopes[..., None, None] * (i - j).abs()
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, S_q)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2), lse


def _reference_varlen(q, k, v, cu_q, cu_k, scale, causal, window, softcap, alibi) -> tuple[Tensor, Tensor]:
    """Each document on its own: q [T_q, H, D], k/v [T_k, H_kv, D] -> (out [T_q, H, D], lse [H, T_q])."""
    outs, lses = [], []
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(starts_q[:-1], starts_q[1:], starts_k[:-1], starts_k[1:]):
        out, lse = reference_attention(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, window, softcap, alibi
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _check_supported(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("the flash-attn stand-in does not compute dropout")


def _forward(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi, ret):
    _check_supported(dropout_p)
    out, lse = reference_attention(
        q, k, v, softmax_scale, causal, (window_left, window_right), softcap, alibi
    )
    return _like_q(q, out), lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64, device=q.device)


def _like_q(q: Tensor, out: Tensor) -> Tensor:
    """``out`` laid out in memory like q, as flash-attn allocates it (``empty_like(q)``, as its fakes say).

    Varlen: tokens past ``cu_seqlens_q[-1]`` are not written by flash-attn; here they are zeros.
    """
    result = torch.zeros_like(q)
    result.narrow(0, 0, out.shape[0]).copy_(out)
    return result


def _grads(fn, dout: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, dout)


def _backward(
    dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, wl, wr, softcap, alibi, det, rng_state=None
):
    _check_supported(dropout_p)
    grads = _grads(
        lambda *t: reference_attention(*t, scale, causal, (wl, wr), softcap, alibi)[0], dout, q, k, v
    )
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    return lse.new_zeros(lse.shape)


def _varlen_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, wl=-1, wr=-1, softcap=0.0, alibi=None,
    ret=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False, num_splits=0,
):  # fmt: skip
    _check_supported(dropout_p)
    out, lse = _reference_varlen(q, k, v, cu_q, cu_k, scale, causal, (wl, wr), softcap, alibi)
    return _like_q(q, out), lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64, device=q.device)


def _varlen_backward(
    dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, wl, wr,
    softcap, alibi, det, rng_state=None, zero_tensors=False,
):  # fmt: skip
    _check_supported(dropout_p)

    def attention(q, k, v):
        return _reference_varlen(q, k, v, cu_q, cu_k, scale, causal, (wl, wr), softcap, alibi)[0]

    for target, grad in zip((dq, dk, dv), _grads(attention, dout, q, k, v)):
        target.copy_(grad)
    return lse.new_zeros(lse.shape)


def _forward_fake(q, k, v, *args, **kwargs):
    batch, seq, heads, _ = q.shape
    lse = q.new_empty(batch, heads, seq, dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


def _varlen_forward_fake(q, k, v, *args, **kwargs):
    tokens, heads, _ = q.shape
    lse = q.new_empty(heads, tokens, dtype=torch.float32)
    return torch.empty_like(q), lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


def _backward_fake(dout, q, k, v, out, lse, *args, **kwargs):
    return lse.new_empty(lse.shape)


@contextlib.contextmanager
def flash_attn_stand_in() -> Iterator[None]:
    """flash-attn 2.x's four ops with CPU kernels, for the duration of the block."""
    installed = flash_attn_is_installed()  # importing flash_attn defined its ops (CUDA kernels, fakes)
    with torch.library._scoped_library("flash_attn", "FRAGMENT") as lib:
        for name, schema, kernel, fake in (
            ("_flash_attn_forward", FORWARD_SCHEMA, _forward, _forward_fake),
            ("_flash_attn_backward", BACKWARD_SCHEMA, _backward, _backward_fake),
            ("_flash_attn_varlen_forward", VARLEN_FORWARD_SCHEMA, _varlen_forward, _varlen_forward_fake),
            ("_flash_attn_varlen_backward", VARLEN_BACKWARD_SCHEMA, _varlen_backward, _backward_fake),
        ):
            if not installed:
                lib.define(name + schema)
                torch.library.register_fake(f"flash_attn::{name}", fake, lib=lib)
            lib.impl(name, kernel, "CPU")
        yield


# --------------------------------------------------------------------------------------------------
# the user-facing functions, calling the ops as flash-attn 2.x does


def _pad_head_dim(t: Tensor) -> Tensor:
    """flash-attn's kernels take head dims in multiples of 8; its Functions pad q/k/v (and dout)."""
    return F.pad(t, (0, -t.shape[-1] % 8)) if t.shape[-1] % 8 else t


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
    ):
        head_dim = q.shape[-1]
        q, k, v = (_pad_head_dim(t) for t in (q, k, v))
        options = (dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes)
        out, lse, _, rng_state = torch.ops.flash_attn._flash_attn_forward(q, k, v, *options, False)
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        ctx.options, ctx.deterministic = options, deterministic
        return out[..., :head_dim]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_backward(
            _pad_head_dim(dout), q, k, v, out, lse, dq, dk, dv, *ctx.options, ctx.deterministic,
            rng_state=rng_state,
        )  # fmt: skip
        head_dim = dout.shape[-1]
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *[None] * 7


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic,
    ):  # fmt: skip
        lengths = (max_q, max_k)
        options = (dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes)
        out, lse, _, rng_state = torch.ops.flash_attn._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, *lengths, *options
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
        ctx.lengths, ctx.options, ctx.deterministic = lengths, options, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, *ctx.lengths, *ctx.options, ctx.deterministic,
            rng_state=rng_state,
        )  # fmt: skip
        return dq, dk, dv, *[None] * 11


def _stand_in_flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    """flash_attn.flash_attn_func: q [B, S, H, D], k/v [B, S, H_kv, D] -> [B, S, H, D]."""
    if return_attn_probs:
        raise NotImplementedError("the stand-in does not return attention probabilities")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _FlashAttnFunc.apply(
        q, k, v, dropout_p, scale, causal, window_size, softcap, alibi_slopes, deterministic
    )


def _stand_in_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """flash_attn.flash_attn_varlen_func: q [T, H, D], documents at cu_seqlens (int32) -> [T, H, D]."""
    if return_attn_probs or block_table is not None:
        raise NotImplementedError("the stand-in does not return attention probabilities or page KV")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _FlashAttnVarlenFunc.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal,
        window_size, softcap, alibi_slopes, deterministic,
    )  # fmt: skip


if flash_attn_is_installed():
    from flash_attn import flash_attn_func, flash_attn_varlen_func
else:
    flash_attn_func, flash_attn_varlen_func = _stand_in_flash_attn_func, _stand_in_flash_attn_varlen_func
