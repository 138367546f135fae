"""Defects and needless refusals found outside the suite (issue 48), as regression tests: each module of
tests/unit/found_modules.py equals one device (loss and every gradient), ranks simulated in one process.
Before their fixes the float lengths and the max-pooled head trained silently wrong (gradient errors 0.95
and 1 - 1/P), the last-position pick recursed without end, and the others were refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import grad_rel_err, rel_err
from lightning_autosp.compiler import symbols
from tests.distributed.modules import VOCAB
from tests.unit.found_modules import (
    FlippedMaskedMean,
    LengthAsFloat,
    MixtralRouterLoss,
    PairwiseReward,
    PooledAttention,
    SectionsAfterAScan,
    StepIdioms,
    TorchEncoder,
    TwoScansPooled,
)
from tests.unit.sp_graphs import simulate_compiled_step, simulate_step, single_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# name -> (module, batch size); sp=3 for those whose attention heads (if any) divide by 3
CASES = {
    "length_as_reciprocal": (lambda: LengthAsFloat("reciprocal"), 1),
    "length_as_float": (lambda: LengthAsFloat("float"), 1),
    "length_as_sqrt": (lambda: LengthAsFloat("sqrt"), 2),
    "pairwise_reward": (PairwiseReward, 2),
    "encoder_batch_1": (TorchEncoder, 1),
    "mixtral_router_loss": (MixtralRouterLoss, 1),
    "max_pooled_attention": (lambda: PooledAttention("max"), 1),
    "last_position_pairwise": (lambda: PooledAttention("last"), 2),
    "rotary_in_step": (lambda: StepIdioms("rotary_in_step"), 2),
    "running_mean": (lambda: StepIdioms("running_mean"), 1),
    "keepdim_mean": (lambda: StepIdioms("keepdim_mean"), 2),
    "last_slice": (lambda: StepIdioms("last_slice"), 1),
    "flipped_masked_mean": (FlippedMaskedMean, 1),
    "sections_after_a_scan": (SectionsAfterAScan, 2),
}
THREE_RANKS = ["length_as_float", "pairwise_reward", "max_pooled_attention", "last_position_pairwise"]


def batch_of(batch_size: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (batch_size, length), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100
    attention_mask = torch.ones_like(ids)
    attention_mask[0, -2:] = 0  # the first row padded on the right
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "cls": torch.randint(0, 3, (batch_size,), generator=generator),
    }


def assert_exact(module: torch.nn.Module, batch: dict, simulate) -> None:
    # One device first: transformers sets its output capturing up on a first call, under a lock Dynamo
    # cannot trace (a graph break on that call only).
    loss, grads = single_device(module, batch)
    simulated = simulate(module, batch)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4


@pytest.mark.parametrize(
    ("case", "length", "world"),
    [(case, 23, 2) for case in CASES] + [(case, 26, 4) for case in CASES] + [(c, 35, 3) for c in THREE_RANKS],
)
def test_found_module_is_exact(case: str, length: int, world: int) -> None:
    factory, batch_size = CASES[case]
    torch.manual_seed(0)
    module = factory()
    batch = batch_of(batch_size, length)
    assert_exact(module, batch, lambda m, b: simulate_step(m, b, world))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pairwise_reward", "encoder_batch_1"])
def test_found_module_is_exact_under_inductor_and_sac(case: str) -> None:
    """The defaults users get, at an odd length."""
    factory, batch_size = CASES[case]
    torch.manual_seed(0)
    module = factory()
    batch = batch_of(batch_size, 23)
    assert_exact(module, batch, lambda m, b: simulate_compiled_step(m, b, 2, compiler="inductor", sac=True))


def test_two_scans_on_the_whole_sequence_are_exact() -> None:
    """Traced whole, the graph serves its traced length only, so the second scan's odd-length halves,
    which end at a sum of floors no guard proves is the length, are read as the length they equal."""
    torch.manual_seed(0)
    assert_exact(TwoScansPooled(), batch_of(3, 23), lambda m, b: simulate_step(m, b, 3, whole=True))


def test_a_value_gathered_whole_meets_this_ranks_tokens_refused_not_crashed(monkeypatch) -> None:
    """Where that size is not read as the length (as the guards alone leave it), the head's input comes
    back gathered whole: it is refused, naming the op and the line; it once crashed on the sizes."""
    proven_only = symbols.as_length
    monkeypatch.setattr(
        symbols, "as_length", lambda env, expr, lengths, pinned=False: proven_only(env, expr, lengths)
    )
    torch.manual_seed(0)
    with pytest.raises(NotImplementedError, match=r"mul at .*found_modules\.py:\d+ .* gathered whole"):
        simulate_step(TwoScansPooled(), batch_of(3, 23), 3, whole=True)
