"""Sequence sharding of batches: every rank of an sp group keeps only its slice of the sequence.

Note [Sequence sharding]
    A sequence of S tokens is split over the P ranks of an sp group into contiguous, balanced
    shards (``torch.tensor_split`` sizes: the first S % P ranks get one token more), so S need not
    divide by P. Rank r owns global positions ``[offset_r, offset_r + S_r)``. A tensor derived
    from the sequence whose global length differs from S (``labels[:, 1:]`` has S - 1 positions)
    keeps the same boundaries: rank r owns ``[offset_r, offset_{r+1})`` clipped to its length, and
    the last rank owns everything from its offset to the end. The compiler relies on this rule to
    make slices, pads and shifts of sharded tensors globally correct (see ``compiler/sp_pass.py``).

Note [Ring layouts]
    With ``ring_degree`` R > 1 the sp group is R ring ranks of U = P / R Ulysses ranks each (sp rank
    r = ring * U + ulysses). Attention gathers a ring rank's tokens from its U Ulysses ranks (all-to-all,
    in sp rank order), then passes K/V blocks around the ring. Under a causal mask, the ring rank
    holding the end of the sequence does 2R-1 times the work of the one holding the start, so the
    "zigzag" layout cuts the sequence into 2R balanced chunks and gives ring rank i chunks i and
    2R-1-i; its tokens (ascending) are then split into U balanced contiguous pieces, one per Ulysses
    rank, so an sp rank may hold two ranges. "contiguous" keeps the balanced layout above. Either
    way every rank holds its positions in ascending order, and a sequence-derived tensor of another
    length follows the same rule: a rank owns its positions below that length, and the owner of the
    last token also owns the positions past the end (a right pad). Positions, the label shift, slices,
    the loss and attention all read this one map (``SequenceShard.positions``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

RingLayout = Literal["zigzag", "contiguous"]
RING_LAYOUTS = ("zigzag", "contiguous")

# Every rank's shard must hold at least 2 tokens: Dynamo specializes a dim of size 1 (and 0) to a
# constant, a broadcastable one, so a 1-token shard would compile a graph without the sequence symbol
# whose collectives and rewrites differ from its peers'. A sequence of 2 * sp_size tokens gives every
# rank 2 in every layout (contiguous: balanced sizes; zigzag: 2R chunks of at least U tokens, two per
# ring rank, split over its U Ulysses ranks), and a shorter one leaves some rank fewer than 2 in all.
MIN_TOKENS_PER_RANK = 2


@dataclass(frozen=True)
class LengthClass:
    """The global lengths one compiled graph serves: every length with ``remainder`` left over when split
    over ``world`` ranks, in the contiguous balanced layout (Note [One graph for every length] in
    ``compiler/symbols.py``)."""

    world: int
    remainder: int

    def __str__(self) -> str:
        return f"every length = {self.remainder} mod {self.world}"


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's tokens sit in the global sequence.

    ``rank_ranges`` lists, per sp rank, the global ``[start, end)`` ranges it holds, ascending and in
    local order; ``None`` is the balanced contiguous layout (one range per rank, in rank order).
    ``ring_degree`` groups the ranks into ring x Ulysses (Note [Ring layouts]).
    """

    global_len: int
    seq_lens: tuple[int, ...]
    rank: int
    ring_degree: int = 1
    rank_ranges: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @classmethod
    def balanced(cls, global_len: int, world: int, rank: int) -> SequenceShard:
        if global_len < world:
            raise ValueError(
                f"The sequence has {global_len} tokens but sp_size={world}: every sp rank needs at least "
                f"one token. Use sequences of at least {world} tokens or a smaller sp_size."
            )
        return cls(global_len, _balanced_sizes(global_len, world), rank)

    @classmethod
    def for_ring(
        cls, global_len: int, world: int, rank: int, ring_degree: int, layout: RingLayout = "zigzag"
    ) -> SequenceShard:
        """The layout of ``world`` sp ranks as ``ring_degree`` ring ranks x ``world // ring_degree``
        Ulysses ranks (Note [Ring layouts]). ``ring_degree=1`` is exactly :meth:`balanced`."""
        if layout not in RING_LAYOUTS:
            raise ValueError(f"ring_layout={layout!r} is not supported; use one of {RING_LAYOUTS}.")
        if world % ring_degree:
            raise ValueError(f"ring_degree={ring_degree} must divide sp_size={world}.")
        if ring_degree == 1 or layout == "contiguous":
            return replace(cls.balanced(global_len, world, rank), ring_degree=ring_degree)
        ulysses = world // ring_degree
        chunks = _balanced_sizes(global_len, 2 * ring_degree) if global_len >= 2 * ring_degree else ()
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        rank_ranges: list[tuple[tuple[int, int], ...]] = []
        for ring in range(ring_degree if chunks else 0):
            pieces = [(starts[c], starts[c] + chunks[c]) for c in (ring, 2 * ring_degree - 1 - ring)]
            tokens = chunks[ring] + chunks[2 * ring_degree - 1 - ring]
            if tokens < ulysses:
                break
            for part in _balanced_sizes(tokens, ulysses):
                taken, pieces = _take(pieces, part)
                rank_ranges.append(taken)
        if len(rank_ranges) != world:
            raise ValueError(
                f"The sequence has {global_len} tokens but the zigzag layout of sp_size={world} with "
                f"ring_degree={ring_degree} needs at least {max(world, 2 * ring_degree)}. Use longer "
                "sequences, a smaller sp_size or ring_layout='contiguous'."
            )
        seq_lens = tuple(sum(end - start for start, end in ranges) for ranges in rank_ranges)
        return cls(global_len, seq_lens, rank, ring_degree, tuple(rank_ranges))

    @property
    def is_contiguous(self) -> bool:
        return self.rank_ranges is None

    @property
    def length_class(self) -> LengthClass | None:
        """The lengths a graph compiled for this layout can serve; None: this length only (ring layouts)."""
        if not self.is_contiguous or self.ring_degree != 1:
            return None
        return LengthClass(self.world, self.global_len % self.world)

    def ranges_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The global ``[start, end)`` ranges ``rank`` holds, in its local order."""
        if self.rank_ranges is not None:
            return self.rank_ranges[rank]
        start = sum(self.seq_lens[:rank])
        return ((start, start + self.seq_lens[rank]),)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self.ranges_of(self.rank)

    def positions(self, length: int | None = None, rank: int | None = None) -> list[int]:
        """Global positions ``rank`` (default: this one) owns of a sequence-derived tensor of ``length``
        positions (default: the sequence), in local order (Note [Ring layouts])."""
        length = self.global_len if length is None else length
        ranges = self.ranges_of(self.rank if rank is None else rank)
        owned = [p for start, end in ranges for p in range(start, min(end, length))]
        if length > self.global_len and any(end == self.global_len for _, end in ranges):
            owned.extend(range(self.global_len, length))
        return owned

    def counts(self, length: int | None = None) -> list[int]:
        """How many positions of a sequence-derived tensor of ``length`` positions each rank owns."""
        if self.is_contiguous:  # by bounds: the length may be a SymInt (Note [One graph for every length])
            length = self.global_len if length is None else length
            return [stop - start for start, stop in self.owned_ranges(length)]
        return [len(self.positions(length, rank)) for rank in range(self.world)]

    def owned_ranges(self, length: int) -> list[tuple[int, int]]:
        """Every rank's ``owned_range(length)``, in rank order (contiguous shards)."""
        return [replace(self, rank=rank).owned_range(length) for rank in range(self.world)]

    def sequence_order(self, length: int | None = None) -> list[int]:
        """Indices that put every rank's shard of a sequence-derived tensor of ``length`` positions (default:
        the sequence), concatenated in rank order, back in sequence order."""
        positions = [p for rank in range(self.world) for p in self.positions(length, rank)]
        return sorted(range(len(positions)), key=positions.__getitem__)

    @property
    def ulysses_degree(self) -> int:
        return self.world // self.ring_degree

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    @property
    def ulysses_seq_lens(self) -> tuple[int, ...]:
        """Shard lengths of the Ulysses ranks of this rank's ring rank (the all-to-all's group)."""
        first = self.ring_rank * self.ulysses_degree
        return self.seq_lens[first : first + self.ulysses_degree]

    def ring_ranges(self, ring_rank: int) -> tuple[tuple[int, int], ...]:
        """The global ranges a ring rank attends for: its Ulysses ranks' ranges, joined, in order."""
        first = ring_rank * self.ulysses_degree
        merged: list[tuple[int, int]] = []
        for rank in range(first, first + self.ulysses_degree):
            for start, end in self.ranges_of(rank):
                if merged and merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], end)
                else:
                    merged.append((start, end))
        return tuple(merged)

    @property
    def world(self) -> int:
        return len(self.seq_lens)

    @property
    def local_len(self) -> int:
        return self.seq_lens[self.rank]

    @property
    def offset(self) -> int:
        self._require_contiguous("offset")
        return sum(self.seq_lens[: self.rank])

    def owned_range(self, length: int) -> tuple[int, int]:
        """Global positions this rank owns of a sequence-derived tensor of ``length`` positions."""
        self._require_contiguous("owned_range")
        start = min(self.offset, length)
        if self.rank == self.world - 1:
            return start, length
        return start, min(self.offset + self.local_len, length)

    def take(self, tensor: Tensor, dim: int) -> Tensor:
        """This rank's slice of ``tensor``, which holds the whole sequence along ``dim``."""
        pieces = [tensor.narrow(dim, start, end - start) for start, end in self.ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _require_contiguous(self, what: str) -> None:
        if not self.is_contiguous:
            raise RuntimeError(
                f"SequenceShard.{what} is defined for contiguous shards only; use positions()."
            )


def _balanced_sizes(total: int, parts: int) -> tuple[int, ...]:
    """``torch.tensor_split`` sizes: the first ``total % parts`` parts get one more."""
    base, extra = divmod(total, parts)
    return tuple(base + (p < extra) for p in range(parts))


def _take(
    pieces: list[tuple[int, int]], count: int
) -> tuple[tuple[tuple[int, int], ...], list[tuple[int, int]]]:
    """The first ``count`` positions of ``pieces`` (ranges in order) as ranges, and what is left."""
    taken, left = [], list(pieces)
    while count:
        start, end = left.pop(0)
        size = min(count, end - start)
        if taken and taken[-1][1] == start:  # chunks that touch make one range
            taken[-1] = (taken[-1][0], start + size)
        else:
            taken.append((start, start + size))
        if start + size < end:
            left.insert(0, (start + size, end))
        count -= size
    return tuple(taken), left


def find_sequence_length(batch: Any, seq_dim: int, sequence_keys: Sequence[str] | None) -> int:
    """The global sequence length: of ``input_ids`` (or ``sequence_keys``), else of the first token tensor."""
    return find_sequence(batch, seq_dim, sequence_keys)[0]


def find_sequence(
    batch: Any, seq_dim: int, sequence_keys: Sequence[str] | None
) -> tuple[int, tuple[int, ...]]:
    """The global sequence length and the batch's dims before ``seq_dim``, both read from the tensor that
    defines the sequence: ``input_ids`` (or ``sequence_keys``), else the first token tensor."""
    if isinstance(batch, Mapping):
        keys = list(sequence_keys) if sequence_keys else [k for k in ("input_ids",) if k in batch]
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"sequence_keys {missing} are not in the batch (keys: {sorted(batch)}).")
        lengths = {k: _seq_len(batch[k], seq_dim, k) for k in keys}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"The sequence tensors disagree on their length along seq_dim={seq_dim}: {lengths}. "
                "Pad them to one length in the collate function."
            )
        if lengths:
            return next(iter(lengths.values())), tuple(batch[keys[0]].shape[:seq_dim])
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    for tensor in tensors:
        if tensor.dim() > seq_dim and not tensor.is_floating_point():
            return tensor.shape[seq_dim], tuple(tensor.shape[:seq_dim])
    shapes = [tuple(t.shape) for t in tensors]
    raise ValueError(
        f"No tensor in the batch has a sequence dimension seq_dim={seq_dim} (tensor shapes: {shapes}). "
        "Return token ids shaped (batch, seq) from the dataloader, or set AutoSPStrategy(seq_dim=...)."
    )


def _seq_len(tensor: Any, seq_dim: int, name: str) -> int:
    if not isinstance(tensor, Tensor) or tensor.dim() <= seq_dim:
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(
            f"batch[{name!r}] has shape {shape}, which has no seq_dim={seq_dim}. "
            "Set AutoSPStrategy(seq_dim=...) to the sequence dimension of your token tensors."
        )
    return tensor.shape[seq_dim]


def check_sequence_length(global_len: int, sp_size: int) -> None:
    """The one length rule of the sharded step: at least ``MIN_TOKENS_PER_RANK`` tokens per sp rank."""
    if global_len < MIN_TOKENS_PER_RANK * sp_size:
        raise ValueError(
            f"The sequence has {global_len} tokens but sp_size={sp_size} needs at least "
            f"{MIN_TOKENS_PER_RANK * sp_size}: every sp rank must hold {MIN_TOKENS_PER_RANK} tokens or more. "
            f"Use sequences of at least {MIN_TOKENS_PER_RANK * sp_size} tokens (pad them in the collate "
            "function) or a smaller sp_size."
        )


def sequence_dim(
    tensor: Tensor, seq_dim: int, global_len: int, batch_dims: tuple[int, ...] | None = None
) -> int | None:
    """The dim of ``tensor`` that carries the sequence: ``seq_dim`` when it has the sequence's length; else
    the one later dim that has it (Qwen2-VL's multimodal ``position_ids``, [B, 3, S] or [3, B, S]); None
    when no dim or several later dims have it (a pairwise mask [B, 1, S, S] stays whole).

    With ``batch_dims`` (the sequence tensor's dims before ``seq_dim``), a length alone is not taken for a
    sequence: at ``seq_dim`` the dims before it must be the batch's (or 1, broadcast), and before a later
    dim the batch size (or 1) must appear. So a feature tensor [N, F] whose width F happens to equal the
    sequence length, with N not the batch size (a multimodal model's image features), stays whole."""
    if tensor.dim() <= seq_dim:
        return None
    if tensor.shape[seq_dim] == global_len:
        leading = tensor.shape[:seq_dim]
        if batch_dims is None or len(batch_dims) != len(leading):
            return seq_dim
        return seq_dim if all(size in (batch, 1) for size, batch in zip(leading, batch_dims)) else None
    later = [d for d in range(seq_dim + 1, tensor.dim()) if tensor.shape[d] == global_len]
    if len(later) != 1:
        return None
    if batch_dims and not ({*batch_dims, 1} & set(tensor.shape[: later[0]])):
        return None
    return later[0]


def shard_batch(
    batch: Any,
    *,
    world: int,
    rank: int,
    seq_dim: int = 1,
    sequence_keys: Sequence[str] | None = None,
    ring_degree: int = 1,
    ring_layout: RingLayout = "zigzag",
    on_shard: Callable[[Tensor, int], None] | None = None,
    whole: bool = False,
) -> tuple[Any, SequenceShard]:
    """Keep this rank's slice of every tensor that carries the sequence (``whole``: keep the tensors whole
    for the compiled step to cut, Note [Tracing at the whole sequence's length] in
    ``compiler/whole_sequence.py``).

    A tensor carries the sequence along the dim :func:`sequence_dim` finds: ``seq_dim`` when it has the
    global sequence length (the length of ``input_ids``, or of ``sequence_keys``), else the one later dim
    that has it, its dims before it lining up with the batch's. Shapes: [B, S, ...] -> [B, S_r, ...];
    [B, 3, S] -> [B, 3, S_r]. With ``ring_degree`` > 1 the slice follows ``ring_layout`` (Note [Ring
    layouts]). ``on_shard`` is called with every slice kept and its sequence dim (the strategy tags them
    for the compiler). A sequence shorter than :func:`check_sequence_length` allows raises before any
    tensor is sliced.
    """
    global_len, batch_dims = find_sequence(batch, seq_dim, sequence_keys)
    check_sequence_length(global_len, world)
    shard = SequenceShard.for_ring(global_len, world, rank, ring_degree, ring_layout)

    def narrow(tensor: Tensor) -> Tensor:
        dim = sequence_dim(tensor, seq_dim, global_len, batch_dims)
        if dim is None:
            return tensor
        local = tensor if whole else shard.take(tensor, dim)
        if on_shard is not None:
            on_shard(local, dim)
        return local

    return apply_to_collection(batch, Tensor, narrow), shard


def gather_sequence(
    tensor: Tensor, shard: SequenceShard, group: Any, dim: int, length: int | None = None
) -> Tensor:
    """Every sp rank's slice of ``tensor`` along ``dim`` -> the whole sequence, in sequence order.

    A collective over ``group`` (the sp group); shards may be uneven. ``length``: the whole tensor's size
    along ``dim`` when it is derived from the sequence (S - 1 after a shift); default the sequence's.
    """
    in_rank_order = torch.cat(all_gather_uneven(tensor, dim, shard.counts(length), group), dim=dim)
    return in_rank_order if shard.is_contiguous else in_sequence_order(in_rank_order, shard, dim, length)


def all_gather_uneven(tensor: Tensor, dim: int, counts: list[int], group: Any) -> list[Tensor]:
    """Every rank's ``tensor``, ``counts[rank]`` long along ``dim``, in rank order (padded to the longest
    to gather)."""
    padded = tensor.new_zeros([*tensor.shape[:dim], max(counts), *tensor.shape[dim + 1 :]])
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    gathered = [torch.empty_like(padded) for _ in counts]
    torch.distributed.all_gather(gathered, padded, group=group)
    return [part.narrow(dim, 0, count) for part, count in zip(gathered, counts)]


def in_sequence_order(gathered: Tensor, shard: SequenceShard, dim: int, length: int | None = None) -> Tensor:
    """Shards concatenated in rank order -> the sequence order, under any layout."""
    order = torch.tensor(shard.sequence_order(length), device=gathered.device)
    return gathered.index_select(dim, order)
