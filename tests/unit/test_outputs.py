"""Which values leaving a compiled step are gathered whole (``lightning_autosp.outputs``), in one process."""

from __future__ import annotations

import pytest
import torch

from lightning_autosp.compiler.prove.layout import REPLICATE, Tag, shard
from lightning_autosp.data import SequenceShard
from lightning_autosp.outputs import whole_sequence

SHARD = SequenceShard.balanced(10, 2, 0)


def test_values_without_a_shard_tag_are_returned_as_they_are() -> None:
    value = torch.ones(2, 5)
    for tag in (None, Tag(REPLICATE)):
        assert whole_sequence(value, tag, SHARD, group=None, flat_in_rank_order=False) is value


def test_a_prediction_with_tokens_flattened_with_the_batch_is_refused_naming_the_fix() -> None:
    flat = Tag(shard(0, flat=(0,)), (20,))  # [B * S_r, V]: logits.view(-1, V)
    with pytest.raises(ValueError, match=r"shape \(10, 4\).*gather_predictions=False"):
        whole_sequence(torch.ones(10, 4), flat, SHARD, group=None, flat_in_rank_order=False)
