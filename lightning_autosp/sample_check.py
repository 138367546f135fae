"""The ranks of an sp group check that they hold the same sample before each step.

Note [Ranks hold the same sample]
    Sequence parallelism splits one sample over the ranks of an sp group: each keeps its slice, and the
    all-to-alls put the slices back together around attention. If the loader hands the ranks of a group
    different samples, rank 0's first half and rank 1's second half are stitched into a sequence that
    never existed, and training goes on without an error. Lightning's distributed sampler splits over
    dp groups (``AutoSPStrategy.distributed_sampler_kwargs``), but several loaders do not go through it:
    an ``IterableDataset`` that shards by the global rank (as streaming datasets do),
    ``use_distributed_sampler=False``, or a custom ``DistributedSampler`` over all ranks.

    So before sharding, every rank digests its sequence tensors (the global length and a position-weighted
    sum of each tensor's values, in int64, wrapping on overflow; computed where the batch is, no copy to
    the host) and the sp group all-gathers the digests: one all-gather of 3 int64 per rank and step, and
    one wait for it. Any difference raises the same ``ValueError`` on every rank, naming the ranks and
    how to fix the loader, before any compiled collective runs. ``AutoSPStrategy(check_samples=False)``
    turns the check off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_autosp.data import find_sequence, sequence_dim

# Odd multiplier of Knuth's multiplicative hash: positions weighted by it make a swap of two tokens
# change the sum.
_POSITION_WEIGHT = 2654435761
_NO_SEQUENCE = -1


def sample_digest(
    batch: Any, seq_dim: int, sequence_keys: Sequence[str] | None, device: torch.device
) -> torch.Tensor:
    """[global length, number of sequence tensors, their combined checksum], int64 on ``device``.

    The sequence tensors are those the strategy shards (``data.sequence_dim``). A batch
    without a sequence gives a length of -1 (its own error is raised after the ranks have compared)."""
    try:
        global_len, batch_dims = find_sequence(batch, seq_dim, sequence_keys)
    except ValueError:
        return torch.tensor([_NO_SEQUENCE, 0, 0], dtype=torch.int64, device=device)
    tensors: list[torch.Tensor] = []
    apply_to_collection(
        batch,
        torch.Tensor,
        lambda t: tensors.append(t) if sequence_dim(t, seq_dim, global_len, batch_dims) is not None else None,
    )
    combined = torch.zeros((), dtype=torch.int64, device=device)
    for index, tensor in enumerate(tensors):
        combined = combined * 31 + _checksum(tensor.to(device)) + index
    counts = torch.tensor([global_len, len(tensors)], dtype=torch.int64, device=device)
    return torch.cat([counts, combined.reshape(1)])


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the tensor's values (of their bits, for floats), in wrapping int64."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
        flat = flat.view(bits)
    elif flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    positions = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
    return (flat.to(torch.int64) * (positions * _POSITION_WEIGHT)).sum()


def check_same_sample(
    batch: Any,
    *,
    group: dist.ProcessGroup,
    seq_dim: int,
    sequence_keys: Sequence[str] | None,
    device: torch.device,
    dp_rank: int,
    sp_size: int,
) -> None:
    """All-gather the sample digest over the sp ``group``; raise the same ``ValueError`` on every rank of
    the group if their sequence tensors differ (Note [Ranks hold the same sample])."""
    digest = sample_digest(batch, seq_dim, sequence_keys, device)
    gathered = [torch.empty_like(digest) for _ in range(sp_size)]
    dist.all_gather(gathered, digest, group=group)
    digests = [tuple(d.tolist()) for d in gathered]
    if len(set(digests)) == 1:
        return
    mine = digests[dist.get_rank(group)]
    if mine[0] == _NO_SEQUENCE:
        return  # this rank's batch has no sequence: sharding raises its own error next, on this rank
    raise ValueError(different_samples_message(digests, dp_rank, sp_size))


def different_samples_message(digests: list[tuple[int, ...]], dp_rank: int, sp_size: int) -> str:
    """Which ranks of sp group ``dp_rank`` hold which sample, and how to fix the loader."""
    holders: dict[tuple[int, ...], list[int]] = {}
    for sp_rank, digest in enumerate(digests):
        holders.setdefault(digest, []).append(sp_rank)
    first = dp_rank * sp_size
    groups = "; ".join(
        f"sp rank(s) {ranks} (global {[first + r for r in ranks]})"
        + (" have no sequence tensor" if digest[0] == _NO_SEQUENCE else f": {digest[0]} tokens")
        for digest, ranks in holders.items()
    )
    return (
        f"The {sp_size} ranks of sp group {dp_rank} hold different samples ({len(holders)} different "
        f"ones: {groups}). Sequence parallelism splits one sample over the ranks of an sp group, so they "
        "must all load the same one; here the model would train on pieces of different samples stitched "
        "together. Shard data by the dp rank, not the global rank: keep Lightning's distributed sampler "
        "(Trainer(use_distributed_sampler=True), the default, for map-style datasets); a custom sampler or "
        "an IterableDataset must split by trainer.strategy.dp_rank over trainer.strategy.dp_size "
        "(e.g. DistributedSampler(dataset, num_replicas=strategy.dp_size, rank=strategy.dp_rank)), and "
        "shuffling must use the same seed on every rank. AutoSPStrategy(check_samples=False) turns this "
        "check off."
    )
