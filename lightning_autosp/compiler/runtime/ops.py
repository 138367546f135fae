"""Collectives the SP pass inserts.

The all-to-alls around attention, the all-reduce of the loss (the volume) and the windows of the sequence
that slices and convolutions read across shard boundaries are plain Python functions built from PyTorch's
functional collectives (``torch.ops._c10d_functional``): the pass inserts a call to
them in the Dynamo graph, AOTAutograd traces through them, and Inductor sees real collectives
(``all_to_all_single`` / ``all_reduce`` + ``wait_tensor``) with the copies around them as ordinary ops it
can fuse and free (Note [Functional collectives]). Their gradients are the functional collectives'
registered autograd formulas: the reverse all-to-all, the sum of the ranks' gradients.

The rarer collectives (token data gathered for a mask, maxima over the sequence) stay ``torch.library``
custom ops: an eager implementation (``torch.distributed`` calls on the group named by ``group_name``),
a fake implementation so Dynamo, AOTAutograd and Inductor can trace shapes, and a registered autograd
formula (a hand-written ``autograd.Function`` around an out-argument collective silently produced zero
gradients in DeepSpeed PR 8491; these ops are checked with ``torch.library.opcheck``).

Shape letters: B batch, H heads, S global sequence, S_r rank r's shard, D head dim, P sp ranks.
Sequence shards may be uneven (``seq_lens`` lists every rank's shard length, in rank order).

Only this module touches private ``torch.distributed`` API (``_resolve_process_group``, the
``_c10d_functional`` ops), so a torch upgrade changes one file.

Note [Functional collectives]
    An opaque custom op that runs a collective eagerly hides everything inside it from Inductor: the
    send and receive buffers, the copies into and out of them, and when the collective may start. As
    functional collectives, the all-to-all's permutes and concatenations are Inductor kernels (fused
    with their neighbours where possible), its buffers are freed at their last use, and the launch is a
    node the scheduler places (``ordering.py`` keeps the launches of every rank in one order). In
    eager runs (``aot_eager``, a rewritten graph run as is) each collective is waited on right away.

Note [Token-major all-to-all]
    The all-to-alls move blocks laid out token-major, [S, H, R] (R: every other dim). What a rank
    receives in ``seq_to_head`` is then every rank's tokens of its head group, one block per rank in
    rank order: already the whole sequence, [S, H/P, R], so the result is a view of the receive
    buffer (uneven shards too; the blocks just differ in length). Head-major blocks ([H, S_r, R])
    would arrive as P sequence pieces to interleave, one copy of q, k and v per attention in forward
    and again in backward. ``head_to_seq`` sends rank j's tokens as one block of rows of attention's
    output (a view where that output is token-major, as SDPA's CPU and flash kernels return it); the
    one copy left, putting the P head groups side by side, is the one any all-to-all of this kind
    needs. Results are views in the memory order they arrive in; the consumer (SDPA, the model's
    own ``transpose(1, 2).reshape``) takes the strides or copies once, and where one cannot take them
    (a masked SDPA under Inductor, ``attention.py``) ``seq_to_head(contiguous=True)`` copies. The
    blocks are rows of a 3-d [tokens, heads, R] tensor, not a flat one: Inductor writes the send
    buffer in the same kernel as the op before it (q's rotary embedding), and with a symbolic length a
    flat buffer's index needs a division by the length in the innermost loop, which the CPU backend
    does not vectorize (the rotary kernel ran 5x slower than hand-written Ulysses' for that alone).

Note [One all-to-all for q, k and v]
    An all-to-all of the sizes attention sends costs about its latency, not its bytes: on 2 CPU
    ranks over gloo, 0.4-0.7 ms from 1 KiB to 1 MiB. Sent one by one, q, k and v cost three of
    them in forward and three more for their gradients in backward, per attention. Nothing runs
    between them (attention needs all three), so ``seq_to_head_packed`` sends the three as one:
    destination j's block is, per token, head group j of q, then of k, then of v, each head's D
    values kept as the innermost run; each arrives as a view of the one receive buffer, as
    ``seq_to_head``'s result does. Its gradient is one all-to-all too (the functional collective's
    autograd formula on the packed buffer). The bytes are the same; the packing copy replaces the
    per-tensor send copy. Packing along the heads, not along flattened heads x D, keeps D the
    innermost loop of the kernel that writes the buffer: a flattened [tokens, Hq*D + 2*Hkv*D] buffer
    put a branch on the innermost index, and that kernel (with q's rotary embedding) ran 4x slower.

Note [Windows of the sequence]
    A convolution along the sequence (stride 1) reads, for its output at position t, the inputs from
    t - pad_left to t - pad_left + dilation * (kernel - 1). On the shard of positions a rank owns, the
    rows near its edges live on the neighbouring ranks. ``sequence_window`` gives each rank the rows
    its outputs read: its own, the boundary rows of the ranks that hold the rest (one all-to-all in
    which each rank sends only the rows another rank's window takes: a few rows per neighbour, not
    the shard), and zeros where the window passes either end of the sequence (the convolution's own
    zero padding, now explicit). The convolution then runs without padding along the sequence and
    gives exactly this rank's outputs. A window may reach past a short neighbour into the next one;
    the rows come from whichever ranks hold them. Its gradient is the all-to-all back (the
    functional collective's formula): the gradient of a boundary row returns to its owner and is added
    to the gradient of that row's own use there.

    A slice of the sequence (the label shift ``labels[:, 1:]``, ``x[:, k:]``) is the same move with a
    window as long as the rank's output: the target of a rank's last position is the next rank's first
    token, which the next rank sends back in the all-to-all, and its gradient (if any) returns with the
    backward all-to-all.

    Tokens joined to the sequence at its start or end (``cat([registers, x, summary])`` along it, the
    joined tokens replicated) are the same move: a rank owns positions of the longer sequence as of any
    sequence-derived one (``SequenceShard.owned_range``), which read x shifted by the prefix's length,
    with the prefix's last rows and the suffix's first in place of the zeros.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers the autograd of _c10d_functional)
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

_COLLECTIVE_NAMESPACES = ("autosp", "_c10d_functional", "c10d_functional")
_functional = torch.ops._c10d_functional


def is_collective(node: object, *, waits: bool = True) -> bool:
    """Whether a graph node talks to other ranks: on the Dynamo graph the collective functions below; on
    ATen graphs our custom ops (namespace ``autosp``) and functional collectives. ``waits=False`` leaves
    out ``wait_tensor``, which only waits for one."""
    target = getattr(node, "target", None)
    if callable(target) and target in COLLECTIVE_FUNCTIONS:
        return True
    packet = getattr(target, "_overloadpacket", None)
    namespace, _, name = getattr(packet, "_qualified_op_name", "").partition("::")
    return namespace in _COLLECTIVE_NAMESPACES and (waits or not name.startswith("wait"))


def collective_name(target: object) -> str:
    """A name for a collective node's target that is the same in every process (no addresses)."""
    if target in COLLECTIVE_FUNCTIONS:
        return f"{__name__}.{target.__name__}"
    return str(target)


def process_group(group_name: str) -> dist.ProcessGroup | None:
    """The process group of that name, or None (no process group, or a name only tests use)."""
    # torch.distributed itself: tests and the planner stand in for this module's ``dist``.
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    try:
        return _resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError):
        return None


def _group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


def _seq_front(x: Tensor, head_dim: int, seq_dim: int) -> Tensor:
    """[..., H at head_dim, ..., S at seq_dim, ...] -> [S, H, R] (R: the other dims, flattened)."""
    moved = x.movedim((seq_dim, head_dim), (0, 1))
    rest = math.prod(moved.shape[2:])  # a rank holding no token has no elements to infer a -1 from
    return moved.reshape(moved.shape[0], moved.shape[1], rest)


def _from_seq_front(x: Tensor, like_shape: list[int], head_dim: int, seq_dim: int) -> Tensor:
    """Inverse of ``_seq_front``: [S', H', R] -> the layout of ``like_shape`` with S', H' swapped in (a
    view: the result keeps the memory order of ``x``)."""
    rest = [
        s
        for d, s in enumerate(like_shape)
        if d not in (head_dim % len(like_shape), seq_dim % len(like_shape))
    ]
    return x.reshape(x.shape[0], x.shape[1], *rest).movedim((0, 1), (seq_dim, head_dim))


def _seq_to_head_shape(shape: list[int], head_dim: int, seq_dim: int, seq_lens: list[int]) -> list[int]:
    out = list(shape)
    out[head_dim] = shape[head_dim] // len(seq_lens)
    out[seq_dim] = sum(seq_lens)
    return out


def _head_to_seq_shape(
    shape: list[int], head_dim: int, seq_dim: int, seq_lens: list[int], rank: int
) -> list[int]:
    out = list(shape)
    out[head_dim] = shape[head_dim] * len(seq_lens)
    out[seq_dim] = seq_lens[rank]
    return out


def _all_to_all(rows: Tensor, output_splits: list[int], input_splits: list[int], group_name: str) -> Tensor:
    """``all_to_all_single`` of blocks of rows (dim 0), waited on; its gradient is the all-to-all back."""
    sent = _functional.all_to_all_single(rows, output_splits, input_splits, group_name)
    return _functional.wait_tensor(sent)


def seq_to_head(
    x: Tensor,
    head_dim: int,
    seq_dim: int,
    seq_lens: list[int],
    rank: int,
    group_name: str,
    contiguous: bool = False,
) -> Tensor:
    """All-to-all from sequence shards to head shards: [B, H, S_r, D] -> [B, H/P, S, D].

    Rank r sends head group j (heads j*H/P .. (j+1)*H/P) of its S_r tokens to rank j and receives
    head group r of every rank's tokens (Note [Token-major all-to-all]): a view of what arrived, or
    with ``contiguous`` a contiguous copy of it.
    """
    (heads_layout,) = seq_to_head_packed([x], head_dim, seq_dim, seq_lens, rank, group_name, contiguous)
    return heads_layout


def seq_to_head_packed(
    xs: list[Tensor],
    head_dim: int,
    seq_dim: int,
    seq_lens: list[int],
    rank: int,
    group_name: str,
    contiguous: bool = False,
) -> tuple[Tensor, ...]:
    """``seq_to_head`` of several tensors (attention's q, k and v) in one all-to-all (Note [One
    all-to-all for q, k and v]): each result as ``seq_to_head`` would return it.

    They must share dtype, device and every dim but the head count. One tensor is ``seq_to_head``.
    """
    world = len(seq_lens)
    fronts = [_seq_front(x, head_dim, seq_dim) for x in xs]  # [S_r, H_i, R] each
    local, rest = fronts[0].shape[0], fronts[0].shape[2]
    # [S_r, P, H_all/P, R]: for destination j, head group j of each tensor in turn
    groups = [front.reshape(local, world, front.shape[1] // world, rest) for front in fronts]
    blocks = groups[0] if len(groups) == 1 else torch.cat(groups, dim=2)
    send = blocks.transpose(0, 1).reshape(world * local, blocks.shape[2], rest)  # [P * S_r, H_all/P, R]
    received = _all_to_all(send, list(seq_lens), [local] * world, group_name)  # [S, H_all/P, R], rank order
    results, start = [], 0
    for x, front in zip(xs, fronts):
        heads = front.shape[1] // world
        piece = received if len(xs) == 1 else received.narrow(1, start, heads)
        start += heads
        heads_layout = _from_seq_front(piece, list(x.shape), head_dim, seq_dim)
        results.append(heads_layout.contiguous() if contiguous else heads_layout)
    return tuple(results)


def head_to_seq(
    x: Tensor, head_dim: int, seq_dim: int, seq_lens: list[int], rank: int, group_name: str
) -> Tensor:
    """All-to-all back from head shards to sequence shards: [B, H/P, S, D] -> [B, H, S_r, D].

    Rank r sends rank j's tokens of its head group to rank j (Note [Token-major all-to-all]).
    """
    world = len(seq_lens)
    front = _seq_front(x, head_dim, seq_dim)  # [S, H/P, R]: rank j's tokens are a block of rows
    heads, rest = front.shape[1], front.shape[2]
    local = seq_lens[rank]
    received = _all_to_all(front.contiguous(), [local] * world, list(seq_lens), group_name)  # [P * S_r, ...]
    # from rank j, head group j of this rank's tokens: [P, S_r, H/P, R] -> [S_r, H, R]
    pieces = received.view(world, local, heads, rest).transpose(0, 1)
    return _from_seq_front(pieces.reshape(local, world * heads, rest), list(x.shape), head_dim, seq_dim)


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """Sum over the sp group; every rank gets the total (out of place).

    Its gradient is the sum of the ranks' gradients: each rank uses the total as its loss, so each
    rank's partial sum feeds every rank's objective (Note [Loss over sequence shards] in losses.py).
    """
    return _functional.wait_tensor(_functional.all_reduce(x, "sum", group_name))


def sequence_window(
    x: Tensor,
    dim: int,
    starts: list[int],
    stops: list[int],
    seq_lens: list[int],
    rank: int,
    group_name: str,
    before: Tensor | None = None,
    after: Tensor | None = None,
) -> Tensor:
    """Rows ``starts[rank]`` to ``stops[rank]`` of the global sequence along ``dim`` (Note [Windows of the
    sequence]): this rank's own, the other ranks' boundary rows that fall inside, and outside the sequence
    zeros, or the last rows of ``before`` and the first of ``after`` (tokens joined to it). ``starts`` /
    ``stops``: every rank's window, in global positions; ``seq_lens``: every rank's shard length
    (contiguous shards, in rank order)."""
    world = len(seq_lens)
    offsets = [sum(seq_lens[:j]) for j in range(world)]
    length = offsets[-1] + seq_lens[-1]

    def overlap(owner: int, reader: int) -> tuple[int, int]:
        """The owner's rows in the reader's window: (start in the owner's shard, count)."""
        first = max(offsets[owner], starts[reader])
        last = min(offsets[owner] + seq_lens[owner], stops[reader])
        return min(first - offsets[owner], seq_lens[owner]), max(last - first, 0)

    rows = x.movedim(dim, 0)
    sends = [overlap(rank, j) if j != rank else (0, 0) for j in range(world)]
    receives = [overlap(j, rank)[1] if j != rank else 0 for j in range(world)]
    send = torch.cat([rows.narrow(0, start, count) for start, count in sends])
    received = _all_to_all(send.contiguous(), receives, [count for _, count in sends], group_name)
    from_below = sum(receives[:rank])
    own_start, own_count = overlap(rank, rank)
    # window positions before 0 and from the length on: zeros, or rows of the joined tokens
    head = max(min(stops[rank], 0) - starts[rank], 0)
    tail_start = max(starts[rank], length)
    tail = max(stops[rank] - tail_start, 0)

    def outside(tokens: Tensor | None, first: int, count: int) -> Tensor:
        """``count`` rows of ``tokens`` from row ``first`` (clamped: ``first`` may lie past them where
        ``count`` is 0), or zeros where nothing is joined."""
        if tokens is None:
            return rows.new_zeros((count, *rows.shape[1:]))
        joined = tokens.movedim(dim, 0)
        return joined.narrow(0, min(first, joined.shape[0]), count)

    pieces = [
        # the prefix holds positions -len(before) .. -1, the suffix length .. length + len(after) - 1
        outside(before, starts[rank] + (0 if before is None else before.shape[dim]), head),
        received.narrow(0, 0, from_below),
        rows.narrow(0, own_start, own_count),
        received.narrow(0, from_below, received.shape[0] - from_below),
        outside(after, tail_start - length, tail),
    ]
    return torch.cat(pieces).movedim(0, dim)


def fetch_rows(
    x: Tensor, dim: int, sends: list[list[int]], receives: list[int], take: list[int], group_name: str
) -> Tensor:
    """``cat([x, rows received from rank 0, ..., from rank P-1], dim).index_select(dim, take)``: this rank's
    part of a slice of the sequence whose rows may sit on any rank (a zigzag layout's label shift, where
    a range's next position is on another rank). ``sends[j]``: this rank's rows (local indices) that rank
    j takes, in the order it wants them; ``receives[j]``: how many rank j sends here. One all-to-all of
    only those rows; the gradient of a fetched row returns to its owner with the all-to-all back."""
    rows = x.movedim(dim, 0)

    def indices(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=x.device)

    sent = rows.index_select(0, indices([i for part in sends for i in part]))
    received = _all_to_all(sent, receives, [len(part) for part in sends], group_name)
    return torch.cat([rows, received]).index_select(0, indices(take)).movedim(0, dim)


def gather_blocks(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    """Every rank's block of ``dim`` side by side, in rank order: a value split over the ranks along
    ``dim`` (heads, channels) made whole on every rank. Its gradient is this rank's block of the sum of
    the ranks' gradients (the functional collective's formula, a reduce-scatter), as for ``all_reduce_sum``:
    every rank uses the whole value in its own copy of the loss."""
    blocks = x.movedim(dim, 0).contiguous()
    gathered = _functional.wait_tensor(_functional.all_gather_into_tensor(blocks, world, group_name))
    return gathered.movedim(0, dim)


COLLECTIVE_FUNCTIONS = frozenset(
    {seq_to_head, seq_to_head_packed, head_to_seq, all_reduce_sum, sequence_window, fetch_rows, gather_blocks}
)


@torch.library.custom_op("autosp::gather_sequence", mutates_args=())
def gather_sequence(x: Tensor, dim: int, seq_lens: list[int], group_name: str) -> Tensor:
    """All-gather of per-token data along ``dim``: [B, S_r, ...] -> [B, S, ...] on every rank.

    For token data the SP pass computes for the whole sequence (document ids and positions behind a
    mask, labels rolled inside the step: Note [Recomputing token data] in ``compiler/lower/recompute.py``);
    it has no gradient. Shards may be
    uneven: each rank sends its shard padded to the longest one, so the collective is the same on all.
    """
    if x.requires_grad:
        raise TypeError(
            "gather_sequence gathers per-token data without gradients (token data), not activations."
        )
    longest = max(seq_lens)
    padded = x.new_zeros([*x.shape[:dim], longest, *x.shape[dim + 1 :]])
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    gathered = [torch.empty_like(padded) for _ in seq_lens]
    dist.all_gather(gathered, padded, group=_group(group_name))
    return torch.cat([part.narrow(dim, 0, length) for part, length in zip(gathered, seq_lens)], dim=dim)


@gather_sequence.register_fake
def _(x: Tensor, dim: int, seq_lens: list[int], group_name: str) -> Tensor:
    shape = list(x.shape)
    shape[dim] = sum(seq_lens)
    return x.new_empty(shape)


@torch.library.custom_op("autosp::all_reduce_extremum", mutates_args=())
def all_reduce_extremum(x: Tensor, op: str, group_name: str) -> Tensor:
    """Elementwise max (``op="max"``) or min over the sp group; every rank gets the result.

    Its gradient goes to the elements equal to the result, split evenly among the ranks that hold one
    (as ``amax`` splits it among ties). What reaches them is the sum of the ranks' gradients of the
    result, as for ``all_reduce_sum``: every rank uses the result in its own copy of the loss, and DDP
    averages the ranks' parameter gradients (Note [Loss over sequence shards] in losses.py). Passing on
    this rank's gradient alone left a max-pooled head's gradients 1/P of one device's.
    """
    reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    result = x.to(torch.int32) if x.dtype == torch.bool else x.clone()
    dist.all_reduce(result, op=reduce_op, group=_group(group_name))
    return result.to(x.dtype)


@all_reduce_extremum.register_fake
def _(x: Tensor, op: str, group_name: str) -> Tensor:
    return torch.empty_like(x)


def _extremum_setup_context(ctx, inputs, output) -> None:
    x, _, ctx.group_name = inputs
    ctx.save_for_backward(x, output)


def _extremum_backward(ctx, grad: Tensor):
    x, output = ctx.saved_tensors
    holds = (x == output).to(grad.dtype)
    total = all_reduce_sum(grad, ctx.group_name)
    return total * holds / all_reduce_sum(holds, ctx.group_name).clamp(min=1), None, None


all_reduce_extremum.register_autograd(_extremum_backward, setup_context=_extremum_setup_context)
