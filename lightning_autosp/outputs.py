"""Whole sequences from values a compiled step left sharded: a metric's arguments, ``predict_step``'s outputs.

Every compiled graph tags its outputs with their layouts (Note [Sequence layouts]); a value tagged
``shard(d)`` holds this rank's tokens along dim ``d``, and its whole sequence is one all-gather over the sp
group away. Whether a value is gathered is read from its tag, which comes from the graph's analysis: the
ranks of an sp group agree on their graphs before any runs (Note [Ranks agree on their graphs]), so every
rank gathers the same values, in the same order, and nobody waits in a collective its peers skip.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_autosp.compiler.prove.layout import SequenceTags, Tag
from lightning_autosp.data import SequenceShard, all_gather_uneven, gather_sequence

# predict_step outputs past this size, gathered whole on every rank, get a warning naming the option.
LARGE_PREDICTION_BYTES = 1 << 30


def whole_sequence(
    tensor: torch.Tensor, tag: Tag | None, shard: SequenceShard, group: Any, *, flat_in_rank_order: bool
) -> torch.Tensor:
    """``tensor`` with every sp rank's tokens, if its tag says it holds a shard; else ``tensor`` itself.

    A collective over ``group`` when it gathers. Tokens flattened with another dim ([B * S_r, ...]) come
    back in rank order when ``flat_in_rank_order`` (enough for a metric over tokens), else raise."""
    if tag is None or not tag.layout.is_shard:
        return tensor  # the same on every rank of the sp group (a loss, a replicated value)
    shape = tuple(tensor.shape)
    if len(tag.layout.dims) != 1:
        raise NotImplementedError(
            f"A value indexed by tokens along several dims ({tag.layout}, shape {shape}) left a compiled "
            "step; only values with one sequence dim are gathered. Return or update with per-token values."
        )
    (dim,) = tag.layout.dims
    value = tensor.detach()
    if dim not in tag.layout.flat and tag.global_sizes:
        return gather_sequence(value, shard, group, dim, length=tag.global_sizes[0])
    if not flat_in_rank_order:
        raise ValueError(
            f"A value of shape {shape} holds this rank's tokens flattened with another dim (dim {dim}), "
            "whose whole-sequence order cannot be rebuilt. Return it with its sequence dim (e.g. "
            "logits.view(batch_size, seq_len, -1) before flattening), or pass "
            "AutoSPStrategy(gather_predictions=False) to keep each rank's shard."
        )
    # Tokens flattened with other dims ([B * S_r]): every rank's piece, in rank order.
    lengths = [torch.empty(1, dtype=torch.long, device=value.device) for _ in range(shard.world)]
    dist.all_gather(lengths, torch.tensor([value.shape[dim]], device=value.device), group=group)
    return torch.cat(all_gather_uneven(value, dim, [int(n) for n in lengths], group), dim=dim)


def gather_predictions(output: Any, tags: SequenceTags, shard: SequenceShard, group: Any) -> Any:
    """``predict_step``'s output with every sequence-sharded tensor whole, as one device returns it."""
    whole_bytes = 0

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal whole_bytes
        whole = whole_sequence(tensor, tags.get(tensor), shard, group, flat_in_rank_order=False)
        whole_bytes += whole.numel() * whole.element_size() if whole is not tensor else 0
        return whole

    gathered = apply_to_collection(output, torch.Tensor, gather)
    if whole_bytes > LARGE_PREDICTION_BYTES:
        rank_zero_warn(
            "predict_step's sequence outputs are gathered whole on every rank: "
            f"{whole_bytes / 2**30:.1f} GiB per batch. AutoSPStrategy(gather_predictions=False) keeps "
            "each rank's shard of them instead (strategy.gather_sequence gathers one when you need it)."
        )
    return gathered
