"""Training steps as users write them (issue 14), through Lightning on 2 processes: every idiom the SP
pass proves exact equals one device on every rank; every idiom it cannot prove stops every rank with the
same error, before any collective. tests/unit/test_user_idioms.py covers more lengths, ranks simulated.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_parity import assert_parity, launch

pytestmark = pytest.mark.distributed
# A hang guard, several times the launch on 2 busy cores (about a minute idle).
IDIOMS_HANG_GUARD_S = 1200

EXACT = [
    "idiom_learned_table",  # Inductor + SAC, 25 tokens (13 + 12)
    "idiom_rope_table",
    "idiom_litgpt",
    "idiom_opt_cumsum_positions",
    "idiom_window_equals_shard",
    "idiom_nll_of_log_softmax",
    "idiom_sum_over_count",  # Inductor + SAC
    "idiom_rolled_labels",
    "idiom_per_token_losses",
    "idiom_sort",  # an all-to-all to channels and back
    "idiom_pool_last_token",  # a partial pick, all-reduced
    "idiom_conv_over_sequence",  # Inductor + SAC: a window with the previous rank's boundary rows
    "idiom_insert_token",  # Inductor + SAC: the sequence one longer, every shard shifted by one
    "idiom_metric_in_training_step",  # a metric's label window beside HF's: once a hang (issue 48)
    "idiom_multimodal_position_ids",  # Qwen2-VL's position_ids [B, 3, S]: sharded along dim 2
    "idiom_branch_on_length_auto",  # Inductor + SAC: traced again at the whole length, one device's branch
    "idiom_chunked_scan_whole",  # trace_length="whole", Inductor + SAC: a Python loop over chunks
    "idiom_truncate_auto",  # `if T > 16: ids = ids[:, -16:]`, traced again whole
]
REFUSED = {
    "idiom_refused_branch_on_length": "branched on the sequence length",
    # a helper under torch.compiler.disable takes a mean over this rank's tokens: silently wrong before the
    # watch (Note [Eager code between graphs])
    "idiom_refused_eager_token_mean": "computed on this rank's part of the sequence outside the compiled",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    return launch(2, [*EXACT, *REFUSED], tmp_path_factory.mktemp("idioms"), IDIOMS_HANG_GUARD_S)


@pytest.mark.timeout(IDIOMS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", EXACT)
def test_idiom_is_exact_on_every_rank(results, case):
    assert_parity(results, case)


@pytest.mark.timeout(IDIOMS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", list(REFUSED))
def test_idiom_is_refused_on_every_rank_alike(results, case):
    errors = {rank: per_case[case].get("error", "") for rank, per_case in results.items()}
    assert all(REFUSED[case] in error and "user_modules.py" in error for error in errors.values()), errors
    assert len(set(errors.values())) == 1, errors  # the same words on every rank: nobody kept going
