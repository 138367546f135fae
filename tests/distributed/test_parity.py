"""Sequence-parallel training equals single-device training: loss and gradients, every rank.

Each launch runs several cases in one ``torchrun`` job (see ``parity_worker.py``) to pay the process
start-up once; each case is then asserted on its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("parity_worker.py")
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4

TWO_RANK_CASES = [
    "llama_gqa",
    "llama_1kv",
    "llama_gqa_no_sac",
    "llama_gqa_auto_sac",
    "llama_len61",
    "gpt_shift",
    "gpt_shift_no_sac",
    "gpt_triu_mask",
    "gpt_graph_break",
    "gpt_ddp_buckets",
    "llama_ddp_buckets",
    "gpt_len61",
]
FOUR_RANK_CASES = ["dp2_sp2", "dp2_sp2_llama"]


def launch(ranks: int, cases: list[str], out: Path, timeout: int) -> dict[int, dict]:
    code, stderr, _ = torchrun(ranks, WORKER, "--out", str(out), "--cases", *cases, timeout=timeout)
    assert code == 0, stderr[-6000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict[int, dict]:
    return launch(
        2,
        [*TWO_RANK_CASES, "gpt_graph_break_in_loop", "gpt_sp_pass_off", "ddp_sp1", "llama_bf16_mixed"],
        tmp_path_factory.mktemp("p2"),
        600,
    )


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory) -> dict[int, dict]:
    return launch(4, FOUR_RANK_CASES, tmp_path_factory.mktemp("p4"), 600)


def assert_parity(results: dict[int, dict], case: str, *, sequence_parallel: bool = True) -> None:
    for rank, per_case in results.items():
        result = per_case[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert (result["all_to_alls"] > 0) == sequence_parallel, result["explain"]
        assert result["checkpoint_keys_match"]
        assert not result["missing_grads"]
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_parity_two_ranks(two_rank_results, case):
    assert_parity(two_rank_results, case)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_parity_dp2_sp2(four_rank_results, case):
    assert_parity(four_rank_results, case)


@pytest.mark.timeout(700)
def test_bf16_mixed_parity_within_bf16_rounding(two_rank_results):
    # Against a single-device run under the same CPU bf16 autocast; bf16 has 8 bits of mantissa (2**-7).
    for rank, per_case in two_rank_results.items():
        result = per_case["llama_bf16_mixed"]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["all_to_alls"] > 0
        assert result["loss_rel_err"] <= 1e-2 and result["grad_rel_err"] <= 3e-2, (rank, result)


@pytest.mark.timeout(700)
def test_sp_size_1_is_plain_ddp(two_rank_results):
    assert_parity(two_rank_results, "ddp_sp1", sequence_parallel=False)


@pytest.mark.timeout(700)
def test_ddp_buckets_split_the_graph(two_rank_results):
    # The bucketed case must really reach the backend as several sub-graphs, or it tests nothing.
    assert two_rank_results[0]["gpt_ddp_buckets"]["graphs"] > 2
    assert two_rank_results[0]["llama_ddp_buckets"]["graphs"] > 2


@pytest.mark.timeout(700)
def test_parity_breaks_without_the_sp_pass(two_rank_results):
    # Negative control: same harness, passes disabled; the parity check must notice.
    result = two_rank_results[0]["gpt_sp_pass_off"]
    assert "error" not in result, result.get("error")
    assert result["all_to_alls"] == 0
    assert result["loss_rel_err"] > 1e-3 and result["grad_rel_err"] > 1e-2


@pytest.mark.timeout(700)
def test_graph_break_in_a_loop_is_an_error_not_a_silent_fallback(two_rank_results):
    for per_case in two_rank_results.values():
        assert "fell back to eager" in per_case["gpt_graph_break_in_loop"]["error"]


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_parity_inductor_end_to_end(tmp_path):
    assert_parity(launch(2, ["gpt_inductor"], tmp_path, 800), "gpt_inductor")
