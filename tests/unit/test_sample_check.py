"""The same-sample digest (Note [Ranks hold the same sample]): what changes it, what does not."""

from __future__ import annotations

import pytest
import torch

from lightning_autosp import AutoSPStrategy
from lightning_autosp.sample_check import different_samples_message, sample_digest

CPU = torch.device("cpu")


def digest(batch: dict) -> list[int]:
    return sample_digest(batch, seq_dim=1, sequence_keys=None, device=CPU).tolist()


def batch(seed: int = 0, length: int = 24) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "loss_weight": torch.ones(2, length)}


def test_the_same_sample_gives_the_same_digest_and_another_one_another():
    assert digest(batch(0)) == digest(batch(0))
    assert digest(batch(0)) != digest(batch(1))
    assert digest(batch(0))[:2] == [24, 3]  # the length, and the three tensors that carry the sequence


def test_swapped_tokens_and_changed_floats_change_the_digest():
    swapped = batch(0)
    swapped["input_ids"][0, [3, 4]] = swapped["input_ids"][0, [4, 3]]
    assert digest(swapped) != digest(batch(0))
    weighted = batch(0)
    weighted["loss_weight"][1, 5] = 0.5
    assert digest(weighted) != digest(batch(0))


def test_tensors_that_do_not_carry_the_sequence_are_left_out():
    with_meta = {**batch(0), "sample_id": torch.tensor([7, 9])}
    other_meta = {**batch(0), "sample_id": torch.tensor([1, 2])}
    assert digest(with_meta) == digest(other_meta) == digest(batch(0))


def test_a_batch_without_a_sequence_is_marked_not_raised():
    assert digest({"features": torch.ones(2, 24, 8)})[0] == -1


def test_the_message_names_the_ranks_of_each_sample_and_the_fix():
    message = different_samples_message([(24, 3, 11), (24, 3, 12), (24, 3, 11)], dp_rank=1, sp_size=3)
    assert "The 3 ranks of sp group 1 hold different samples (2 different ones" in message
    assert "sp rank(s) [0, 2] (global [3, 5])" in message and "sp rank(s) [1] (global [4])" in message
    assert "trainer.strategy.dp_rank" in message and "check_samples=False" in message


def test_check_samples_must_be_a_bool():
    assert AutoSPStrategy(check_samples=False).check_samples is False
    with pytest.raises(TypeError, match=r"check_samples='no' must be True"):
        AutoSPStrategy(check_samples="no")
