"""Sequence sharding of batches (``lightning_autosp.data``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_autosp.data import SequenceShard, shard_batch


def test_balanced_uneven() -> None:
    first, second = (SequenceShard.balanced(61, 2, r) for r in range(2))
    assert first.seq_lens == second.seq_lens == (31, 30)
    assert (first.local_len, first.offset, first.world) == (31, 0, 2)
    assert (second.local_len, second.offset, second.world) == (30, 31, 2)
    assert SequenceShard.balanced(26, 4, 0).seq_lens == (7, 7, 6, 6)
    assert SequenceShard.balanced(26, 4, 3).offset == 20


def test_balanced_needs_a_token_per_rank() -> None:
    with pytest.raises(ValueError, match="at least"):
        SequenceShard.balanced(3, 4, 0)
    assert SequenceShard.balanced(4, 4, 3).seq_lens == (1, 1, 1, 1)


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        # labels[:, 1:] / logits[:, :-1] of 61 tokens: the last rank loses a position
        (60, [(0, 31), (31, 60)]),
        (61, [(0, 31), (31, 61)]),
        # pad(labels, (0, 1)): the last rank gains one
        (62, [(0, 31), (31, 62)]),
    ],
)
def test_owned_range(length: int, expected: list[tuple[int, int]]) -> None:
    assert [SequenceShard.balanced(61, 2, r).owned_range(length) for r in range(2)] == expected


def test_owned_range_shorter_than_the_offset() -> None:
    shard = SequenceShard.balanced(8, 4, 3)  # offset 6
    assert shard.owned_range(4) == (4, 4)  # empty, not negative
    assert SequenceShard.balanced(8, 4, 1).owned_range(3) == (2, 3)


@settings(deadline=None)
@given(global_len=st.integers(1, 200), world=st.integers(1, 8), extra=st.integers(-3, 3))
def test_owned_ranges_tile_any_length(global_len: int, world: int, extra: int) -> None:
    assume(global_len >= world)
    length = max(0, global_len + extra)
    shards = [SequenceShard.balanced(global_len, world, r) for r in range(world)]
    assert sum(s.local_len for s in shards) == global_len
    assert max(s.local_len for s in shards) - min(s.local_len for s in shards) <= 1
    ranges = [s.owned_range(length) for s in shards]
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(lo <= hi for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _batch(global_len: int = 61) -> dict[str, torch.Tensor]:
    ids = torch.arange(2 * global_len).reshape(2, global_len)
    return {
        "input_ids": ids,
        "labels": ids + 1000,
        "attention_mask": torch.ones(2, global_len, dtype=torch.long),
        "weights": torch.rand(2, 7),  # another length: untouched
        "scale": torch.tensor(2.0),
    }


@pytest.mark.parametrize(("rank", "start", "length"), [(0, 0, 31), (1, 31, 30)])
def test_shard_dict_batch(rank: int, start: int, length: int) -> None:
    batch = _batch()
    sharded, shard = shard_batch(batch, world=2, rank=rank)
    assert shard == SequenceShard.balanced(61, 2, rank)
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(sharded[key], batch[key][:, start : start + length])
    assert sharded["weights"] is batch["weights"]
    assert sharded["scale"] is batch["scale"]


def test_float_tensor_of_the_sequence_length_is_sharded() -> None:
    batch = {"input_ids": torch.zeros(2, 10, dtype=torch.long), "loss_weights": torch.rand(2, 10)}
    sharded, _ = shard_batch(batch, world=2, rank=1)
    assert torch.equal(sharded["loss_weights"], batch["loss_weights"][:, 5:])


def test_features_whose_width_equals_the_length_stay_whole() -> None:
    # fuzz seed 2026181683641: image features [N, F] with F == the sequence length and N != the batch size
    # were sharded along F, and the step crashed in Dynamo instead of training
    batch = {"input_ids": torch.zeros(1, 12, dtype=torch.long), "features": torch.rand(4, 12)}
    sharded, _ = shard_batch(batch, world=2, rank=0)
    assert sharded["features"] is batch["features"]
    assert sharded["input_ids"].shape == (1, 6)


def test_position_ids_broadcast_over_the_batch_are_sharded() -> None:
    batch = {
        "input_ids": torch.zeros(3, 10, dtype=torch.long),
        "position_ids": torch.arange(10).reshape(1, 10),  # one row for the whole batch
        "mrope_positions": torch.arange(30).reshape(3, 1, 10),  # Qwen2-VL's [3, B, S], B broadcast
    }
    sharded, _ = shard_batch(batch, world=2, rank=1)
    assert torch.equal(sharded["position_ids"], batch["position_ids"][:, 5:])
    assert torch.equal(sharded["mrope_positions"], batch["mrope_positions"][..., 5:])


def test_shard_tuple_batch() -> None:
    ids = torch.arange(20).reshape(2, 10)
    features = torch.rand(2, 3)
    (sharded_ids, sharded_features), shard = shard_batch((ids, features), world=2, rank=1)
    assert shard.global_len == 10
    assert torch.equal(sharded_ids, ids[:, 5:])
    assert sharded_features is features


def test_first_integer_tensor_defines_the_length_without_input_ids() -> None:
    batch = {"noise": torch.rand(2, 9), "tokens": torch.zeros(2, 8, dtype=torch.long)}
    sharded, shard = shard_batch(batch, world=2, rank=0)
    assert shard.global_len == 8
    assert sharded["tokens"].shape == (2, 4)
    assert sharded["noise"] is batch["noise"]


def test_sequence_keys() -> None:
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "tokens": torch.zeros(2, 8, dtype=torch.long)}
    sharded, shard = shard_batch(batch, world=2, rank=1, sequence_keys=["tokens"])
    assert shard.global_len == 8
    assert sharded["tokens"].shape == (2, 4)
    assert sharded["input_ids"] is batch["input_ids"]


def test_seq_dim() -> None:
    ids = torch.arange(24).reshape(6, 4)  # (seq, batch)
    sharded, shard = shard_batch({"input_ids": ids}, world=3, rank=2, seq_dim=0)
    assert shard.global_len == 6
    assert torch.equal(sharded["input_ids"], ids[4:])


def test_sequence_keys_must_agree() -> None:
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 7, dtype=torch.long)}
    with pytest.raises(ValueError, match="disagree"):
        shard_batch(batch, world=2, rank=0, sequence_keys=("input_ids", "labels"))


def test_missing_sequence_key() -> None:
    with pytest.raises(ValueError, match="are not in the batch"):
        shard_batch({"input_ids": torch.zeros(2, 8)}, world=2, rank=0, sequence_keys=["tokens"])


def test_no_sequence_tensor() -> None:
    with pytest.raises(ValueError, match="No tensor in the batch"):
        shard_batch({"features": torch.rand(2, 8)}, world=2, rank=0)
    with pytest.raises(ValueError, match="No tensor in the batch"):
        shard_batch((torch.zeros(8, dtype=torch.long),), world=2, rank=0)


def test_seq_dim_too_large() -> None:
    with pytest.raises(ValueError, match="no seq_dim=2"):
        shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, world=2, rank=0, seq_dim=2)
    with pytest.raises(ValueError, match="seq_dim=2"):
        shard_batch((torch.zeros(2, 8, dtype=torch.long),), world=2, rank=0, seq_dim=2)


def test_sequence_shorter_than_sp_size() -> None:
    with pytest.raises(ValueError, match="at least"):
        shard_batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, world=4, rank=0)


@pytest.mark.parametrize("global_len", [1, 3])
@pytest.mark.parametrize("ring_degree", [1, 2])
def test_one_length_rule_for_every_short_sequence(global_len: int, ring_degree: int) -> None:
    """1 token and 3 tokens over 2 ranks get the same rule and words (once: ">= 2", then ">= 4")."""
    world = 2 * ring_degree
    needed = 2 * world
    ids = torch.zeros(1, global_len * ring_degree, dtype=torch.long)
    with pytest.raises(
        ValueError, match=rf"has {ids.shape[1]} tokens but sp_size={world} needs at least {needed}"
    ):
        shard_batch({"input_ids": ids}, world=world, rank=0, ring_degree=ring_degree)


@pytest.mark.parametrize(
    ("world", "ring_degree", "layout"),
    [(2, 1, "zigzag"), (4, 2, "zigzag"), (6, 3, "zigzag"), (4, 2, "contiguous"), (8, 2, "zigzag")],
)
def test_two_tokens_per_rank_is_enough_in_every_layout(world: int, ring_degree: int, layout: str) -> None:
    ids = torch.arange(2 * world).view(1, -1)
    for rank in range(world):
        _, shard = shard_batch(
            {"input_ids": ids}, world=world, rank=rank, ring_degree=ring_degree, ring_layout=layout
        )
        assert min(shard.seq_lens) == 2


@pytest.mark.parametrize("shape", [(2, 3, 10), (3, 2, 10)])
def test_sequence_on_a_later_dim_is_sharded_along_it(shape: tuple[int, ...]) -> None:
    """Qwen2-VL's multimodal position_ids ([B, 3, S] or [3, B, S]) carry the sequence on dim 2."""
    positions = torch.arange(60).view(shape)
    found = []
    batch = {"input_ids": torch.zeros(2, 10, dtype=torch.long), "position_ids": positions}
    sharded, _ = shard_batch(batch, world=2, rank=1, on_shard=lambda t, dim: found.append(dim))
    assert torch.equal(sharded["position_ids"], positions[..., 5:])
    assert found == [1, 2]


def test_a_tensor_with_the_length_on_several_later_dims_stays_whole() -> None:
    mask = torch.ones(2, 1, 10, 10)  # pairwise: read whole by the compiler
    sharded, _ = shard_batch(
        {"input_ids": torch.zeros(2, 10, dtype=torch.long), "mask": mask}, world=2, rank=0
    )
    assert sharded["mask"] is mask
