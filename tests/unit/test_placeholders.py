"""Features inserted into the sequence at placeholder tokens (Note [Features at placeholders]): how every
HF vision-language model puts its image, video or audio features into the token embeddings,
``inputs_embeds.masked_scatter(mask, features)``. Each equals one device (loss and every gradient, the
feature tower's included), ranks simulated in one process, with placeholders across the shard cuts, all
on one rank, and batches whose samples hold different numbers of them. Without the rewrite the op has no
rule and is refused, so every case here runs the rewrite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.modules import VOCAB
from tests.unit.found_modules import FeaturesThenMaskedAttention
from tests.unit.sp_graphs import simulate_step
from tests.unit.test_found import assert_exact

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PLACEHOLDER, HIDDEN, PIXELS = VOCAB - 1, 16, 12


class FeatureInsert(torch.nn.Module):
    """Token embeddings, a feature tower on replicated inputs, the features at the placeholders, a head.

    ``mask``: how the model spells the placeholder mask, ``"expand_as"`` ([B, S, D], a user's idiom),
    ``"unsqueeze"`` ([B, S, 1], as transformers' ``get_placeholder_mask``) or ``"elements"`` (a mask that
    varies along the hidden dim too, so features go to single elements)."""

    def __init__(self, mask: str = "unsqueeze") -> None:
        super().__init__()
        self.mask = mask
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.tower = torch.nn.Linear(PIXELS, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        embeds = self.embed(ids)
        features = self.tower(batch["pixels"]).tanh()  # [images, D]
        placeholders = ids == PLACEHOLDER
        if self.mask == "expand_as":
            mask = placeholders.unsqueeze(-1).expand_as(embeds)
        elif self.mask == "unsqueeze":
            mask = placeholders.unsqueeze(-1)
        else:
            mask = placeholders.unsqueeze(-1) & (torch.arange(HIDDEN) % 3 == 0)
        embeds = embeds.masked_scatter(mask, features)
        logits = self.head(embeds.tanh())
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def batch_with_placeholders(length: int, starts: list[list[int]]) -> dict[str, torch.Tensor]:
    """One row per sample; ``starts[i]``: where sample i's runs of 3 placeholders begin."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, PLACEHOLDER, (len(starts), length), generator=generator)
    for row, runs in enumerate(starts):
        for start in runs:
            ids[row, start : start + 3] = PLACEHOLDER
    images = sum(len(runs) for runs in starts) * 3
    labels = ids.masked_fill(ids == PLACEHOLDER, -100)
    return {"input_ids": ids, "labels": labels, "pixels": torch.randn(images, PIXELS, generator=generator)}


# name -> (length, placeholder runs per sample, sp ranks)
CASES = {
    "across_the_cut_batch_1": (23, [[10]], 2),
    "batch_2_different_counts": (23, [[10, 17], [1]], 2),
    "four_ranks": (26, [[5, 12], [18]], 4),
    "all_on_the_last_rank": (23, [[19]], 2),
    "prime_length_three_ranks": (31, [[9, 20], [0, 28]], 3),
    # pixels [images, 12] as wide as the sequence: they were taken for sequence data and sharded, and the
    # step crashed in Dynamo (fuzz seed 2026181683641; data.sequence_dim now checks the batch dims)
    "pixels_as_wide_as_the_sequence": (PIXELS, [[4]], 2),
}


@pytest.mark.parametrize("mask", ["unsqueeze", "expand_as", "elements"])
@pytest.mark.parametrize("case", list(CASES))
def test_features_at_placeholders_are_exact(case: str, mask: str) -> None:
    length, starts, world = CASES[case]
    torch.manual_seed(0)
    module = FeatureInsert(mask)
    batch = batch_with_placeholders(length, starts)
    assert_exact(module, batch, lambda m, b: simulate_step(m, b, world))


def test_the_rewrite_is_reported() -> None:
    torch.manual_seed(0)
    simulated = simulate_step(FeatureInsert(), batch_with_placeholders(23, [[10]]), 2)
    lines = [line for report in simulated.reports for line in report.normalized]
    assert any(line.startswith("masked_scatter as a gather of feature rows") for line in lines), lines


@pytest.mark.parametrize(
    ("length", "starts", "world"),
    [(6, [[0], [3], [1]], 2), (21, [[2], [9], [17]], 4)],
    ids=["shrunk", "found"],
)
def test_features_then_a_mask_built_from_the_length(length: int, starts: list[list[int]], world: int) -> None:
    """The fuzzer's crash (seed 120603627): batch 3, a boolean causal mask after features at placeholders."""
    torch.manual_seed(0)
    batch = batch_with_placeholders(length, starts)
    module = FeaturesThenMaskedAttention(heads=world)
    assert_exact(module, batch, lambda m, b: simulate_step(m, b, world))
