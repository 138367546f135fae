"""Sequence sharding of batches: every rank of an sp group keeps only its slice of the sequence.

Note [Sequence sharding]
    A sequence of S tokens is split over the P ranks of an sp group into contiguous, balanced
    shards (``torch.tensor_split`` sizes: the first S % P ranks get one token more), so S need not
    divide by P. Rank r owns global positions ``[offset_r, offset_r + S_r)``. A tensor derived
    from the sequence whose global length differs from S (``labels[:, 1:]`` has S - 1 positions)
    keeps the same boundaries: rank r owns ``[offset_r, offset_{r+1})`` clipped to its length, and
    the last rank owns everything from its offset to the end. The compiler relies on this rule to
    make slices, pads and shifts of sharded tensors globally correct (see ``compiler/sp_pass.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's tokens sit in the global sequence."""

    global_len: int
    seq_lens: tuple[int, ...]
    rank: int

    @classmethod
    def balanced(cls, global_len: int, world: int, rank: int) -> SequenceShard:
        if global_len < world:
            raise ValueError(
                f"The sequence has {global_len} tokens but sp_size={world}: every sp rank needs at least "
                f"one token. Use sequences of at least {world} tokens or a smaller sp_size."
            )
        base, extra = divmod(global_len, world)
        return cls(global_len, tuple(base + (r < extra) for r in range(world)), rank)

    @property
    def world(self) -> int:
        return len(self.seq_lens)

    @property
    def local_len(self) -> int:
        return self.seq_lens[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.seq_lens[: self.rank])

    def owned_range(self, length: int) -> tuple[int, int]:
        """Global positions this rank owns of a sequence-derived tensor of ``length`` positions."""
        start = min(self.offset, length)
        if self.rank == self.world - 1:
            return start, length
        return start, min(self.offset + self.local_len, length)


def find_sequence_length(batch: Any, seq_dim: int, sequence_keys: Sequence[str] | None) -> int:
    """The global sequence length: of ``input_ids`` (or ``sequence_keys``), else of the first token tensor."""
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
            return next(iter(lengths.values()))
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    for tensor in tensors:
        if tensor.dim() > seq_dim and not tensor.is_floating_point():
            return tensor.shape[seq_dim]
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


def shard_batch(
    batch: Any,
    *,
    world: int,
    rank: int,
    seq_dim: int = 1,
    sequence_keys: Sequence[str] | None = None,
) -> tuple[Any, SequenceShard]:
    """Keep this rank's slice of every tensor that carries the sequence.

    A tensor carries the sequence when its ``seq_dim`` has the global sequence length (the length of
    ``input_ids``, or of ``sequence_keys``). Shapes: [B, S, ...] -> [B, S_r, ...].
    """
    global_len = find_sequence_length(batch, seq_dim, sequence_keys)
    shard = SequenceShard.balanced(global_len, world, rank)

    def narrow(tensor: Tensor) -> Tensor:
        if tensor.dim() > seq_dim and tensor.shape[seq_dim] == global_len:
            return tensor.narrow(seq_dim, shard.offset, shard.local_len)
        return tensor

    return apply_to_collection(batch, Tensor, narrow), shard
