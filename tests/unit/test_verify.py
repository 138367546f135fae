"""``lightning_autosp.tools.verify``'s pieces that need no processes: the batch cut, the gradient metric, the
reference step and the result's verdict and tables. The runs themselves: tests/examples/test_cli.py
(``autosp verify``), tests/zoo and tests/reliability (``verify`` under torchrun)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from benchmarks.common import grad_rel_err
from lightning_autosp.tools.verify import (
    RankResult,
    VerifyResult,
    cut_sequence,
    non_default_options,
    parameter_errors,
    reference_step,
)
from tests.distributed.modules import GPTModule


def test_cut_sequence_cuts_every_tensor_that_carries_the_sequence():
    batch = {
        "input_ids": torch.zeros(2, 30, dtype=torch.long),
        "mask": torch.ones(2, 30),
        "ids": torch.ones(2),
    }
    cut = cut_sequence(batch, 12)
    assert cut["input_ids"].shape == (2, 12) and cut["mask"].shape == (2, 12) and cut["ids"].shape == (2,)
    assert cut_sequence(batch, 64) is batch
    with pytest.raises(ValueError, match="positive number of tokens"):
        cut_sequence(batch, 0)


def test_parameter_errors_are_the_parity_metric_per_parameter():
    reference = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-6, 0.0]), "c": torch.tensor([3.0])}
    grads = {"a": torch.tensor([1.0, -2.2]), "b": torch.tensor([2e-6, 0.0])}  # c: no gradient
    errors = parameter_errors(grads, reference)
    assert errors["a"] == pytest.approx(0.1)
    assert errors["b"] == pytest.approx(1e-6 / 3e-3)  # below the floor of 1e-3 x the largest gradient
    assert errors["c"] == 1.0
    assert max(errors.values()) == pytest.approx(grad_rel_err(grads, reference))


def test_reference_step_starts_from_the_given_weights():
    torch.manual_seed(0)
    module = GPTModule()
    batch = {"input_ids": torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(0))}
    own = reference_step(module, batch, "32-true", torch.device("cpu"), seed=0)
    zeroed = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    from_zeros = reference_step(module, batch, "32-true", torch.device("cpu"), seed=0, weights=zeroed)
    assert own.loss != from_zeros.loss
    assert from_zeros.loss == pytest.approx(math.log(48))  # all-zero logits: uniform over the vocabulary
    assert set(own.grads) == {name for name, _ in module.named_parameters()}
    assert all(p.grad is None for p in module.parameters())  # the user's module is left alone


def _result(ranks: list[RankResult], precision: str = "32-true") -> VerifyResult:
    return VerifyResult(ranks, 2, 2, "cpu", precision, 24, {"compiler": "aot_eager"}, "graph 0: ...", "GPT")


def test_the_worst_rank_decides_and_the_tolerance_follows_the_precision():
    exact = RankResult(0, 2.0, 2.0 + 2e-7, {"w": 3e-6, "b": 1e-7})
    off = RankResult(1, 2.0, 2.0 + 2e-7, {"w": 2e-4, "b": 1e-7})
    assert _result([exact, exact]).verdict == "exact"
    result = _result([exact, off])
    assert result.verdict == "not exact" and not result.passed
    assert result.grad_rel_err == pytest.approx(2e-4)
    assert result.worst_parameters(1) == [("w", 1, pytest.approx(2e-4))]
    assert _result([exact, off], precision="bf16-mixed").verdict == "exact"  # within 3e-2
    missing = RankResult(0, 2.0, 2.0, {"w": 0.0}, missing_grads=["head.weight"])
    assert _result([missing]).verdict == "not exact"


def test_a_refusal_is_the_verdict_and_its_message_is_shown():
    error = "NotImplementedError: The SP pass cannot prove this training step exact\n- sort at model.py:3"
    result = _result([RankResult(0, 2.0, error=error), RankResult(1, 2.0, error=error)])
    assert result.verdict == "refused" and result.refusal == error
    markdown = str(result)
    assert "| SP run | raised | every rank | - | no |" in markdown and "- sort at model.py:3" in markdown
    assert markdown.endswith("what to write instead.")
    console = Console(file=io.StringIO(), width=120)
    console.print(result)
    assert "sort at model.py:3" in console.file.getvalue()


def test_an_error_that_is_no_refusal_is_not_called_one():
    error = "MisconfigurationException: No `configure_optimizers()` method defined."
    markdown = str(_result([RankResult(0, 2.0, error=error), RankResult(1, 2.0, error=error)]))
    assert "configure_optimizers" in markdown and "REFUSED" not in markdown
    assert markdown.endswith("Fix what it names and verify again.")


def test_the_tables_show_the_numbers():
    result = _result([RankResult(0, 2.0, 2.0, {"w": 3e-6}), RankResult(1, 2.0, 2.0, {"w": 4e-6})])
    markdown = str(result)
    assert (
        "autosp verify: GPT, sp_size=2 on 2 cpu rank(s), 24 tokens, 32-true, compiler='aot_eager'" in markdown
    )
    assert "| gradients, relative error | 4.0e-06 | rank 1, w | 1e-04 | yes |" in markdown
    assert markdown.endswith("for this module and batch.")


def test_the_title_shows_only_options_that_differ_from_the_defaults():
    options = {"compiler": "aot_eager", "sac": True, "bucket_cap_mb": None, "find_unused_parameters": False}
    assert non_default_options(options) == {"compiler": "aot_eager"}
