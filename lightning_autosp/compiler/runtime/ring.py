"""Ring attention over the ring sub-group of sp, as ``torch.library`` custom ops.

When sp is larger than the heads, the SP pass splits it into U Ulysses ranks x R ring ranks
(Note [Ring layouts] in ``data.py``). After the all-to-all over the U Ulysses ranks
(``ops.seq_to_head``), ring rank i holds q, k, v of its own tokens for H/U heads; ring attention then
gives those queries the keys of every ring rank:

    q, k, v [B, H, L_i, D] -> R steps: attend to the K/V block in hand, pass it to ring rank i + 1
        -> merge the partial outputs by log-sum-exp in fp32 -> out [B, H, L_i, D], lse [B, H, L_i]

Like the all-to-alls in ``ops.py``, each op has an eager implementation (``torch.distributed``
point-to-point calls on the ring group), a fake implementation and a registered autograd formula,
and is checked with ``torch.library.opcheck``.

Note [Ring attention blocks]
    Which keys a query sees is decided by global positions: every ring rank's tokens are global
    ranges (``bounds``: ``[start, end)`` pairs of all ring ranks in ring order, ``range_counts``: how
    many belong to each). The ranges of all ring ranks partition the sequence, so under a causal mask
    a (q range, K/V range) pair is one of three blocks: K/V entirely at or before q's first
    position (every query sees every key), entirely after q's last (nothing to do), or the same
    range (the causal diagonal). Those run on aten's flash or efficient attention kernels, on every
    device, which return the log-sum-exp the merge needs (Note [Ring block kernels] in
    ``ring_kernels.py``). An explicit ``attn_mask`` (``[..., S, S]`` over global positions) is cut to
    the block's rows and columns and computed exactly in fp32, where a query may see no key of a block
    (log-sum-exp -inf, weight 0 in the merge).

    Backward recomputes each block's gradient from the final output and log-sum-exp, as flash
    attention's backward does (P = exp(scores - lse), dS = P * (dP - rowsum(dO * O))), so no
    per-block state is saved. dK/dV accumulate in fp32 and travel with their K/V block; after R
    steps they are one hop from home, and the last exchange delivers them.

Shape letters: B batch, H q heads and Hk K/V heads of this Ulysses rank, L_i ring rank i's tokens,
S the global sequence, D head dim, R ring ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autosp.compiler.runtime import ops
from lightning_autosp.compiler.runtime.ring_kernels import (
    KERNELS,
    BlockKernel,
    accumulation_dtype,
    choose_kernel,
    dense_attention,
    dense_attention_backward,
    softmax_scale,
    warn_dense_once,
)
from lightning_autosp.data import SequenceShard

_KV_TAG, _GRAD_KV_TAG = 0, 1
# every query sees every key; the causal diagonal (same range); exact fp32 math from a mask
BlockKind = Literal["full", "causal", "masked"]


@dataclass(frozen=True)
class Block:
    """One (q range, K/V range) pair: local slices into q and K/V, their global ranges, and the kind."""

    q: slice
    kv: slice
    q_range: tuple[int, int]
    kv_range: tuple[int, int]
    kind: BlockKind


def ring_ranges(bounds: list[int], range_counts: list[int]) -> list[list[tuple[int, int]]]:
    """``bounds`` [s, e, s, e, ...] and ``range_counts`` per ring rank -> each ring rank's ranges."""
    pairs = list(zip(bounds[0::2], bounds[1::2]))
    out, start = [], 0
    for count in range_counts:
        out.append(pairs[start : start + count])
        start += count
    return out


def find_blocks(
    q_ranges: list[tuple[int, int]], kv_ranges: list[tuple[int, int]], is_causal: bool, masked: bool
) -> list[Block]:
    """The blocks one ring step computes (Note [Ring attention blocks]); hidden blocks are left out."""
    blocks = []
    q_at = 0
    for q_start, q_end in q_ranges:
        kv_at = 0
        for kv_start, kv_end in kv_ranges:
            q_slice = slice(q_at, q_at + q_end - q_start)
            kv_slice = slice(kv_at, kv_at + kv_end - kv_start)
            kv_at += kv_end - kv_start
            kind: BlockKind
            if masked:
                kind = "masked"
            elif not is_causal or kv_end - 1 <= q_start:
                kind = "full"
            elif kv_start > q_end - 1:
                continue
            elif (kv_start, kv_end) == (q_start, q_end):
                kind = "causal"
            else:  # overlapping but different ranges: not produced by the layouts, still exact
                kind = "masked"
            blocks.append(Block(q_slice, kv_slice, (q_start, q_end), (kv_start, kv_end), kind))
        q_at += q_end - q_start
    return blocks


def _block_mask(block: Block, attn_mask: Tensor | None, is_causal: bool, device: torch.device) -> Tensor:
    """The mask of a "masked" block: rows at q's global positions, columns at K/V's."""
    q_pos = torch.arange(*block.q_range, device=device)
    kv_pos = torch.arange(*block.kv_range, device=device)
    if attn_mask is not None:
        return attn_mask.index_select(-2, q_pos).index_select(-1, kv_pos)
    if is_causal:
        return q_pos[:, None] >= kv_pos[None, :]
    return torch.ones(len(q_pos), len(kv_pos), dtype=torch.bool, device=device)


def _block_kernel(block: Block, query: Tensor, value: Tensor) -> BlockKernel | None:
    """The aten kernel of a block, or None for exact fp32 math (Note [Ring block kernels])."""
    name, reason = choose_kernel(block.kind == "masked", query, value)
    if reason is not None:
        warn_dense_once(reason)
    return KERNELS.get(name)


def _attend(
    query: Tensor, key: Tensor, value: Tensor, block: Block, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """One block's (output in fp32, log-sum-exp in fp32)."""
    kernel = _block_kernel(block, query, value)
    if kernel is None:
        if mask is None:
            mask = _block_mask(block, None, block.kind == "causal", query.device)
        return dense_attention(query, key, value, mask, scale)
    out, lse = kernel.forward(query, key, value, block.kind == "causal", softmax_scale(query, scale))
    return out.to(lse.dtype), lse


def _attend_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    block: Block,
    mask: Tensor | None,
    scale: float | None,
) -> tuple[Tensor, ...]:
    """One block's (dq, dk, dv) from the final output and log-sum-exp of its queries."""
    kernel = _block_kernel(block, query, value)
    if kernel is None:
        if mask is None:
            mask = _block_mask(block, None, block.kind == "causal", query.device)
        return dense_attention_backward(grad_out, query, key, value, out, lse, mask, scale)
    causal = block.kind == "causal"
    return kernel.backward(grad_out, query, key, value, out, lse, causal, softmax_scale(query, scale))


def _merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's partial result into the running (out, lse) of its query rows, in fp32."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)  # a query that sees no key yet: weights 0, not NaN
    out[..., rows, :] = (
        out[..., rows, :] * torch.exp(old - safe)[..., None]
        + block_out * torch.exp(block_lse - safe)[..., None]
    )
    lse[..., rows] = new


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, shapes: list[list[int]]) -> list[Tensor]:
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _with_length(shape: torch.Size, length: int) -> list[int]:
    return [*shape[:2], length, *shape[3:]]


def _pass_to_next(
    send: Tensor, receive_numel: int, ring_rank: int, world: int, group_name: str, tag: int
) -> Callable[[], Tensor]:
    """Start sending ``send`` to ring rank + 1 and receiving ``receive_numel`` elements from rank - 1.

    Returns a function that waits for both and gives the received tensor; compute runs in between.
    """
    group = ops._group(group_name)
    received = send.new_empty(receive_numel)
    works = [
        dist.irecv(received, group=group, tag=tag, group_src=(ring_rank - 1) % world),
        dist.isend(send.contiguous(), group=group, tag=tag, group_dst=(ring_rank + 1) % world),
    ]

    def wait() -> Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def _lengths(ranges: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in ranges)


def _exchange_shapes(tensors: tuple[Tensor, ...], length: int) -> tuple[list[list[int]], int]:
    shapes = [_with_length(t.shape, length) for t in tensors]
    return shapes, sum(int(torch.Size(shape).numel()) for shape in shapes)


def _block_inputs(block: Block, attn_mask: Tensor | None, query: Tensor) -> Tensor | None:
    if block.kind != "masked" or attn_mask is None:
        return None
    return _block_mask(block, attn_mask, False, query.device)


@torch.library.custom_op("autosp::ring_attention", mutates_args=())
def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    bounds: list[int],
    range_counts: list[int],
    ring_rank: int,
    group_name: str,
) -> tuple[Tensor, Tensor]:
    """Attention of this ring rank's queries over every ring rank's keys: (out [B, H, L_i, D],
    lse [B, H, L_i] fp32). K/V may have fewer heads than q (GQA, as SDPA's ``enable_gqa``)."""
    ranges = ring_ranges(bounds, range_counts)
    world = len(ranges)
    dtype = accumulation_dtype(query.dtype)
    out = query.new_zeros([*query.shape[:3], value.shape[-1]], dtype=dtype)
    lse = query.new_full(query.shape[:3], float("-inf"), dtype=dtype)
    key_value = (key, value)
    for step in range(world):
        owner = (ring_rank - step) % world
        wait = None
        if step < world - 1:  # start passing the block on; it is only read while we compute
            shapes, numel = _exchange_shapes(key_value, _lengths(ranges[(owner - 1) % world]))
            wait = _pass_to_next(_pack(*key_value), numel, ring_rank, world, group_name, _KV_TAG)
        k, v = key_value
        for block in find_blocks(ranges[ring_rank], ranges[owner], is_causal, attn_mask is not None):
            mask = _block_inputs(block, attn_mask, query)
            block_out, block_lse = _attend(
                query[:, :, block.q], k[:, :, block.kv], v[:, :, block.kv], block, mask, scale
            )
            _merge(out, lse, block.q, block_out, block_lse)
        if wait is not None:
            key_value = tuple(_unpack(wait(), shapes))
    return out.to(query.dtype), lse


@ring_attention.register_fake
def _(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    bounds: list[int],
    range_counts: list[int],
    ring_rank: int,
    group_name: str,
) -> tuple[Tensor, Tensor]:
    out = query.new_empty([*query.shape[:3], value.shape[-1]])
    return out, query.new_empty(query.shape[:3], dtype=accumulation_dtype(query.dtype))


@torch.library.custom_op("autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    bounds: list[int],
    range_counts: list[int],
    ring_rank: int,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradient of ``ring_attention``: (dq, dk, dv). K/V go around the ring again, and their gradients
    travel with them back to the ring rank that owns them (Note [Ring attention blocks])."""
    ranges = ring_ranges(bounds, range_counts)
    world = len(ranges)
    dtype = accumulation_dtype(query.dtype)
    # Contiguous gradients, whatever the inputs' strides (the all-to-all hands q, k, v over as views):
    # the fake kernel below says so, and AOTAutograd traces the rest of backward on its word.
    grad_query = query.new_zeros(query.shape, dtype=dtype)
    key_value = (key, value)
    grad_key_value = (key.new_zeros(key.shape, dtype=dtype), value.new_zeros(value.shape, dtype=dtype))
    for step in range(world):
        owner = (ring_rank - step) % world
        next_length = _lengths(ranges[(owner - 1) % world])
        wait_key_value = None
        if step < world - 1:
            shapes, numel = _exchange_shapes(key_value, next_length)
            wait_key_value = _pass_to_next(_pack(*key_value), numel, ring_rank, world, group_name, _KV_TAG)
        k, v = key_value
        grad_k, grad_v = grad_key_value
        for block in find_blocks(ranges[ring_rank], ranges[owner], is_causal, attn_mask is not None):
            rows, cols = block.q, block.kv
            block_grads = _attend_backward(
                grad_out[:, :, rows],
                query[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                block,
                _block_inputs(block, attn_mask, query),
                scale,
            )
            grad_query[:, :, rows] += block_grads[0]
            grad_k[:, :, cols] += block_grads[1]
            grad_v[:, :, cols] += block_grads[2]
        if world > 1:  # after the last step this delivers our own block's gradient home
            grad_shapes, grad_numel = _exchange_shapes(grad_key_value, next_length)
            wait_grads = _pass_to_next(
                _pack(*grad_key_value), grad_numel, ring_rank, world, group_name, _GRAD_KV_TAG
            )
            grad_key_value = tuple(_unpack(wait_grads(), grad_shapes))
        if wait_key_value is not None:
            key_value = tuple(_unpack(wait_key_value(), shapes))
    grad_k, grad_v = grad_key_value
    # dK and dV arrive as views of one buffer; outputs of a custom op must not alias each other.
    return grad_query.to(query.dtype), grad_k.to(key.dtype, copy=True), grad_v.to(value.dtype, copy=True)


@ring_attention_backward.register_fake
def _(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    bounds: list[int],
    range_counts: list[int],
    ring_rank: int,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _ring_setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, *ctx.args = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask)


def _ring_backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    # lse is an internal output (the SP pass reads only ``out``), so its gradient is zero.
    query, key, value, out, lse, attn_mask = ctx.saved_tensors
    grads = ring_attention_backward(grad_out, query, key, value, out, lse, attn_mask, *ctx.args)
    return (*grads, *[None] * (1 + len(ctx.args)))


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup_context)


def ring_args(shard: SequenceShard) -> tuple[list[int], list[int], int]:
    """(bounds, range_counts, ring rank) of ``ring_attention`` for a ``SequenceShard``."""
    per_rank = [shard.ring_ranges(ring) for ring in range(shard.ring_degree)]
    bounds = [position for ranges in per_rank for pair in ranges for position in pair]
    return bounds, [len(ranges) for ranges in per_rank], shard.ring_rank
