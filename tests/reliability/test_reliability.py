"""Reliability: failing ranks, bad input, checkpoints, evaluation, numerics and a property test.

Five ``torchrun`` launches: a rank that raises mid-step (2 ranks), ranks that wedge (4 ranks, dp=2 x
sp=2; see ``fault_worker.py``), ranks that take different collective paths and a rank that compiles late
(2 ranks each, the hang watch), and one 2-rank launch of ``checks_worker.py`` that runs every other check
and records what each rank saw, asserted here one test per property.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.distributed.modules import GPTModule
from tests.launch import torchrun

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4
MAX_EXAMPLES = 4
# Hang guards, not expectations: each job takes well under a tenth of this on 2 idle cores.
JOB_HANG_GUARD_S = 600
CHECKS_HANG_GUARD_S = 1200


# --------------------------------------------------------------------------------------------------
# 1. failing ranks


@pytest.mark.timeout(JOB_HANG_GUARD_S + 60)
def test_a_rank_that_raises_mid_step_ends_the_job_with_its_error():
    # Rank 1 raises inside training_step at step 2, after its forward: rank 0 is already inside the
    # step's collectives. Every rank must exit, non-zero, with rank 1's error in the output, and rank 0
    # because rank 1 failed, not because its own process-group timeout (long, here) ran out.
    args = ["--fault", "raise", "--ranks", "1", "--timeout", str(JOB_HANG_GUARD_S)]
    code, stderr, _ = torchrun(2, HERE / "fault_worker.py", *args, timeout=JOB_HANG_GUARD_S)
    assert code != 0
    assert "RuntimeError: injected failure on rank 1 at step 2" in stderr, stderr[-6000:]
    assert "Timed out" not in stderr, stderr[-6000:]
    assert "AUTOSP_FINISHED" not in stderr


@pytest.mark.timeout(2 * JOB_HANG_GUARD_S + 60)
def test_peers_of_a_wedged_rank_give_up_after_the_strategy_timeout():
    # dp=2 x sp=2 on 4 ranks: ranks 1 and 3 stop forever (alive) inside training_step at step 2, so
    # ranks 0 and 2 wait in their sp group's collectives, a sub-group the DeviceMesh creates. They must
    # fail with AutoSPStrategy(timeout=30) (torch would give sub-groups its 30 min default, which the
    # hang guard would end). The ranks must not time out on each other earlier, while one of them
    # compiles: 30 s is ample on 2 idle cores, but with the suite's other worker running a 2-rank job
    # (6 processes on 2 slow cores) ranks once gave up on each other before the fault step (rank 0:
    # "after=-1.0s", a wedging rank exiting with an error). Such a job runs again with 4x the timeout:
    # load slows the test, it cannot fail it.
    for timeout in (30, 120):
        args = ["--fault", "wedge", "--ranks", "1", "3", "--timeout", str(timeout)]
        code, stderr, _ = torchrun(4, HERE / "fault_worker.py", *args, timeout=JOB_HANG_GUARD_S)
        if not re.search(r"AUTOSP_FAULT rank=\d after=-1\.0s", stderr):
            break
    assert code != 0
    timed_out = []
    for rank in (0, 2):
        found = re.search(rf"AUTOSP_FAULT rank={rank} after=([\d.]+)s (.*)", stderr)
        assert found, f"rank {rank} did not fail by itself:\n{stderr[-6000:]}"
        # Gloo names the timeout it waited for: the strategy's, in milliseconds. The two waiting ranks
        # reach it within moments of each other, so one may instead see the other leave first.
        timed_out.append(f"Timed out waiting {timeout * 1000}ms" in found.group(2))
        assert timed_out[-1] or "Connection closed by peer" in found.group(2), found.group(0)
        # A lower bound only: it waited in the wedged step, for at least most of the timeout.
        assert float(found.group(1)) >= timeout * 0.8, found.group(0)
    assert any(timed_out), stderr[-6000:]


@pytest.mark.timeout(JOB_HANG_GUARD_S + 60)
def test_ranks_that_took_different_collective_paths_end_with_a_report_of_who_waits_where():
    # Rank 0 makes one all-reduce more than rank 1 at step 2: rank 0 waits in it, rank 1 in the step's
    # own collectives. The process group's timeout (600 s) would end them after 10 minutes with gloo's
    # "Timed out"; the hang watch (hang_timeout=10) must end both (the job's guard bounds how long), each
    # naming the collective every rank waits in and the line that called the odd one.
    args = ["--fault", "diverge", "--ranks", "0", "--timeout", "600", "--hang-timeout", "10"]
    code, stderr, _ = torchrun(2, HERE / "fault_worker.py", *args, timeout=JOB_HANG_GUARD_S)
    assert code != 0
    assert "AUTOSP_FINISHED" not in stderr and "Timed out" not in stderr, stderr[-6000:]
    for rank in (0, 1):
        found = re.search(
            rf"\[rank {rank}\] AutoSP: every rank has waited in a collective for at least (\d+) s", stderr
        )
        assert found, f"rank {rank} printed no report:\n{stderr[-6000:]}"
        assert int(found.group(1)) >= 10, found.group(0)  # it waited the watch's timeout out, no less
    assert re.search(r"rank 0 waits in gloo:all_reduce #\d+ .*fault_worker\.py:\d+ in inject", stderr), (
        stderr[-6000:]
    )
    assert re.search(r"rank 1 waits in gloo:\w+ #\d+", stderr), stderr[-6000:]


@pytest.mark.timeout(JOB_HANG_GUARD_S + 60)
def test_a_rank_that_compiles_long_after_its_peers_is_not_taken_for_a_hang():
    # Rank 1 starts compiling SLOW_COMPILE_S (45 s) after rank 0, which waits for it in collectives for
    # more than 4x the hang watch's timeout: the job must train to its end on both ranks.
    args = ["--fault", "slow_compile", "--ranks", "1", "--timeout", "600", "--hang-timeout", "10"]
    code, stderr, _ = torchrun(2, HERE / "fault_worker.py", *args, timeout=JOB_HANG_GUARD_S)
    assert "every rank has waited" not in stderr, stderr[-6000:]
    assert code == 0, stderr[-6000:]
    assert stderr.count("AUTOSP_FINISHED") == 2, stderr[-6000:]


# --------------------------------------------------------------------------------------------------
# one launch for the rest


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("reliability")
    names = ["bad_input", "checkpoint", "fsdp_checkpoint", "validate", "fsdp_validate", "numerics"]
    names.append("property")
    names += ["same_sample", "agreement"]  # short process-group timeouts, like ambiguous_shard's
    names.append("ambiguous_shard")  # last: see checks_worker.py
    args = ["--out", str(out), "--checks", *names, "--max-examples", str(MAX_EXAMPLES)]
    code, stderr, _ = torchrun(2, HERE / "checks_worker.py", *args, timeout=CHECKS_HANG_GUARD_S)
    assert code == 0, stderr[-6000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


def each_rank(checks: dict[int, dict], name: str) -> list[tuple[int, dict]]:
    found = []
    for rank, results in checks.items():
        result = results[name]
        assert "traceback" not in result, f"rank {rank}: {result.get('traceback')}"
        found.append((rank, result))
    return found


# 2. bad input

BAD_INPUT = {
    "no_sequence_tensor": "No tensor in the batch has a sequence dimension seq_dim=1",
    "lengths_disagree": "disagree on their length along seq_dim=1: {'input_ids': 24, 'labels': 23}",
    "missing_sequence_key": "sequence_keys ['tokens'] are not in the batch",
    "seq_dim_missing": "has shape (2, 24), which has no seq_dim=2",
    "sp_larger_than_sequence": "The sequence has 1 tokens but sp_size=2 needs at least 4",
    "one_token_on_a_rank": "The sequence has 3 tokens but sp_size=2 needs at least 4",
}


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_on_every_rank_before_any_collective(checks, case):
    for rank, results in each_rank(checks, "bad_input"):
        outcome = results[case]
        assert outcome["error"] is not None, f"rank {rank} trained on a bad batch"
        assert outcome["error"].startswith("ValueError: "), outcome
        assert BAD_INPUT[case] in outcome["error"], outcome
        # raised by data.py while moving the batch, before the compiled step (and its collectives)
        assert "batch_to_device" in outcome["where"] and "data.py" in outcome["where"], outcome["where"]
    # the worker met a barrier after each case: every rank got through every case
    assert set(checks[0]["bad_input"]) == set(checks[1]["bad_input"]) == set(BAD_INPUT)


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_a_refusal_on_one_rank_stops_every_rank(checks):
    # 2 x 5 tokens over 2 ranks: shards of 3 and 2; only the 2-token shard's trace takes a branch that the
    # whole sequence would not, so only that rank's pass refuses: the ranks agree before any collective.
    errors = set()
    for rank, outcome in each_rank(checks, "ambiguous_shard"):
        assert "branched on the sequence length" in (outcome["error"] or ""), (rank, outcome)
        assert "refused on sp rank(s) 1 of 2" in outcome["error"], (rank, outcome)
        assert outcome["in_step"], (rank, outcome)  # nobody left waiting in a collective
        errors.add(outcome["error"])
    assert len(errors) == 1


# 3. checkpoints


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_resuming_from_a_checkpoint_continues_exactly(checks):
    for rank, result in each_rank(checks, "checkpoint"):
        # SGD with momentum (lr 0.1) under sp=2 follows single-device training ...
        assert result["uninterrupted"] == pytest.approx(result["reference"], rel=LOSS_TOLERANCE), rank
        # ... and steps 4-5 after resuming from the step-3 checkpoint equal the uninterrupted run's.
        assert result["first_three"] == result["uninterrupted"][:3], rank
        assert result["resumed"] == pytest.approx(result["uninterrupted"][3:], abs=1e-6), rank


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_resuming_with_a_different_sp_size(checks):
    # Saved under sp=2 on 2 ranks, resumed under sp=1 (dp=2): the weights load unchanged, and the first
    # loss is the single-device loss of the batch that rank received.
    for rank, result in each_rank(checks, "checkpoint"):
        assert result["resharded_weights_equal_checkpoint"], rank
        assert len(result["resharded_sp1"]) == 1
        assert result["resharded_sp1"][0] == pytest.approx(result["resharded_eager_loss"], rel=LOSS_TOLERANCE)
        # ... and back: saved under sp=1 (dp=2), resumed under sp=2.
        assert result["resharded_back_weights_equal_checkpoint"], rank
        assert len(result["resharded_back_sp2"]) == 1
        assert result["resharded_back_sp2"][0] == pytest.approx(
            result["resharded_back_eager_loss"], rel=LOSS_TOLERANCE
        )


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_fsdp_trains_like_one_device_and_resumes_exactly_from_full_and_distributed_checkpoints(checks):
    for rank, result in each_rank(checks, "fsdp_checkpoint"):
        assert result["uninterrupted"] == pytest.approx(result["reference"], rel=LOSS_TOLERANCE), rank
        assert result["first_three_distributed"] == result["uninterrupted"][:3], rank
        assert result["full_is_file"] and result["distributed_is_directory"], rank
        # steps 4-5 after resuming from the step-3 checkpoint, full file or one shard per rank
        assert result["resumed_full"] == pytest.approx(result["uninterrupted"][3:], abs=1e-6), rank
        assert result["resumed_distributed"] == pytest.approx(result["uninterrupted"][3:], abs=1e-6), rank


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_a_full_fsdp_checkpoint_resumes_under_ddp(checks):
    for rank, result in each_rank(checks, "fsdp_checkpoint"):
        assert result["ddp_weights_equal_checkpoint"], rank
        assert result["resumed_by_ddp"] == pytest.approx(result["uninterrupted"][3:], abs=1e-6), rank


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_fsdp_holds_one_world_th_of_ddps_parameters_gradients_and_optimizer_state(checks):
    # 2 ranks, SGD with momentum: each rank holds half of every tensor (rows split in two; all even here).
    for rank, result in each_rank(checks, "fsdp_checkpoint"):
        for kind in ("params", "grads", "optimizer"):
            ratio = result["fsdp_bytes"][kind] / result["ddp_bytes"][kind]
            assert 0.48 <= ratio <= 0.52, (rank, kind, result["fsdp_bytes"], result["ddp_bytes"])


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_load_from_checkpoint_on_one_process_for_inference(checks):
    result = checks[0]["checkpoint"]
    saved = torch.load(result["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert not [key for key in saved if "_orig_mod" in key]
    module = GPTModule.load_from_checkpoint(result["checkpoint"], map_location="cpu")
    module.eval()
    assert set(module.state_dict()) == set(GPTModule().state_dict())
    with torch.no_grad():
        loss = module.training_step(torch.load(result["step3_batch"]), 0).item()
    # the single-device reference after 3 steps, on the batch of step 4
    assert loss == pytest.approx(result["reference"][3], rel=LOSS_TOLERANCE)


# 4. evaluation


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("check", ["validate", "fsdp_validate"])
def test_validation_loss_equals_single_device(checks, check):
    # GPTModule.validation_step calls self.training_step and logs val_loss; 30 tokens, ignored labels.
    # Under fsdp the module is sharded by the first run (validate) and kept so by the next two.
    for rank, result in each_rank(checks, check):
        assert "error" not in result, (rank, result)
        assert result["all_to_alls"] > 0
        assert result["val_loss"] == pytest.approx(result["reference"], rel=LOSS_TOLERANCE), rank
        assert result["test_loss"] == pytest.approx(result["reference"], rel=LOSS_TOLERANCE), rank


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("check", ["validate", "fsdp_validate"])
def test_predict_returns_whole_sequences_or_each_ranks_slice(checks, check):
    for rank, result in each_rank(checks, check):
        # by default the whole logits (B, S, V) on every rank, as one device returns them
        assert result["predict_shape_ok"], (rank, result)
        assert result["predict_max_abs_err"] < 1e-5, rank
        # gather_predictions=False: this rank's slice, which gather_sequence makes whole
        assert result["kept_shard_length"] == result["shard_length"] < 30, (rank, result)
        assert result["gathered_max_abs_err"] < 1e-5, rank


# 5. numerics


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_an_sp_shard_with_only_ignored_labels(checks, model):
    # Three SGD steps (lr 0.1); in two batches one rank's shard holds only -100 labels (rank 1, then 0).
    for rank, results in each_rank(checks, "numerics"):
        result = results[f"ignored_shard_{model}"]
        assert "error" not in result, (rank, result)
        assert result["finite"] and result["steps"] == 3 and result["all_to_alls"] > 0
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_sequence_lengths_that_vary_between_batches(checks):
    # 14 distinct lengths (6-40 tokens, odd and even; Dynamo's own limit is 8 compiles per function),
    # then the first again, SGD (lr 0.1), Inductor + SAC: exact at every step, each step compiled once
    # per length class (odd, even), not per length; then validation at lengths of its own, equal to one
    # device's, from its own two graphs.
    for rank, results in each_rank(checks, "numerics"):
        result = results["varying_lengths"]
        assert "error" not in result, (rank, result)
        assert result["steps"] == len(result["lengths"]) == 15
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)
        assert result["val_loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        distinct = sorted(set(result["lengths"]))
        assert len(distinct) == 14 and {n % 2 for n in distinct} == {0, 1} and min(distinct) == 6
        # one graph per length class serves every length in it, training and validation alike
        classes = ["every length = 0 mod 2", "every length = 1 mod 2"]
        assert result["layouts"] == classes, result["layouts"]
        expected = {f"{step}@{c}": 1 for step in ("training_step", "validation_step") for c in classes}
        assert result["compiles"] == expected, result["compiles"]
        assert len(set(result["graphs_per_layout"])) == 1, result["graphs_per_layout"]
        assert "compiled for this sequence length only" not in result["explain"], result["explain"]


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("model", ["joined_tokens", "convolution"])
def test_windows_of_the_sequence_at_lengths_that_vary(checks, model):
    # Tokens joined to the sequence and a causal convolution over it (windows of the neighbours' rows, Note
    # [Windows of the sequence]) at lengths that vary, odd and even, shards down to 4 tokens, Inductor +
    # SAC: exact at every step. The joined tokens: one graph per length class. The convolution: one per
    # length, because Inductor's CPU convolution fixes the length it is compiled for (one device too), which
    # explain() names.
    for rank, results in each_rank(checks, "numerics"):
        result = results["varying_windows"]
        assert "error" not in result, (rank, result)
        result = result[model]
        assert result["steps"] == len(result["lengths"]) and result["finite"], (rank, result)
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)
        if model == "joined_tokens":
            classes = ["every length = 0 mod 2", "every length = 1 mod 2"]
            assert result["layouts"] == classes, result["layouts"]
            assert result["compiles"] == {f"training_step@{c}": 1 for c in classes}, result["compiles"]
        else:
            assert sum(result["compiles"].values()) == len(set(result["lengths"])), result["compiles"]
            assert "compiling it fixed the length" in result["explain"], result["explain"]


# 6. property test


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_parity_holds_for_drawn_shapes(checks):
    # hypothesis (derandomized, in the worker): heads {2, 4}, kv heads dividing them, batch 1-3,
    # 8-40 tokens (odd lengths too), a random ignored tail per sample, sp 1 or 2 (dp 2 or 1).
    for rank, result in each_rank(checks, "property"):
        failing = [e for e in result["examples"] if not e["ok"]]
        assert result["error"] is None and not failing, (rank, result["error"], failing)
        assert len(result["examples"]) >= MAX_EXAMPLES // 2, result["examples"]


# 7. the ranks of an sp group agree (tests/reliability/agreement_checks.py)

DIFFERENT_SAMPLES = ["iterable_by_global_rank", "no_distributed_sampler", "sampler_over_all_ranks"]


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", DIFFERENT_SAMPLES)
def test_ranks_with_different_samples_fail_alike_naming_the_ranks_and_the_fix(checks, case):
    errors = set()
    for rank, results in each_rank(checks, "same_sample"):
        outcome = results[case]
        assert outcome["in_step"], (rank, outcome)  # nobody left waiting in a collective
        error = outcome["error"] or ""
        assert error.startswith("ValueError: The 2 ranks of sp group 0 hold different samples"), (
            rank,
            outcome,
        )
        assert "sp rank(s) [0] (global [0])" in error and "sp rank(s) [1] (global [1])" in error, error
        assert "trainer.strategy.dp_rank" in error and "check_samples=False" in error, error
        assert outcome["where"].startswith("sample_check.py:check_same_sample <- strategy.py:batch_to_device")
        errors.add(error)
    assert len(errors) == 1


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", ["iterable_by_dp_rank", "lightning_sampler", "check_off"])
def test_loaders_that_agree_train_and_the_check_can_be_turned_off(checks, case):
    # check_off: the IterableDataset sharded by global rank trains without a word: the check is what
    # stops the cases above.
    for rank, results in each_rank(checks, "same_sample"):
        outcome = results[case]
        assert outcome["error"] is None and outcome["in_step"], (rank, outcome)
        assert "all-to-alls inserted" in outcome["explain"], outcome["explain"]


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_uneven_shards_compile_the_same_signature_on_every_rank(checks):
    signatures = []
    for rank, results in each_rank(checks, "agreement"):
        outcome = results["uneven_shards"]
        assert outcome["verdict"] == "exact", (rank, outcome)
        assert "every length = 1 mod 2; one graph for 25 -> (13, 12)" in outcome["explain"]
        assert outcome["signatures"] and any("seq_to_head" in line for line in outcome["signatures"][0])
        signatures.append(outcome["signatures"])
    assert signatures[0] == signatures[1]


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
def test_a_step_that_branches_on_the_rank_fails_on_every_rank_naming_the_difference(checks):
    # Rank 1 runs the model twice: its graph has more all-to-alls, in another order. Without the exchange
    # of signatures rank 0 would wait in a collective rank 1 never joins, or take its tensors.
    errors = set()
    for rank, results in each_rank(checks, "agreement"):
        outcome = results["branch_on_rank"]
        assert outcome["verdict"] == "refused" and outcome["in_step"], (rank, outcome)
        (error,) = set(outcome["errors"])  # the same on both ranks, gathered by verify
        assert "compiled different graphs" in error and "First difference, entry" in error, error
        assert "torch.distributed.get_rank()" in error, error
        errors.add(error)
    assert len(errors) == 1


DATA_BRANCHES = {
    "branch_on_any_token": "any over the sequence -> all-reduce",
    "branch_on_first_token": "token data computed for the whole sequence",
}


@pytest.mark.timeout(CHECKS_HANG_GUARD_S + 60)
@pytest.mark.parametrize("case", list(DATA_BRANCHES))
def test_graph_breaks_on_data_that_differs_between_shards_branch_alike(checks, case):
    # The condition reads token data only one shard holds (a 3 in rank 1's half; the first token, on rank
    # 0): the SP pass computes it over the whole sequence, so both ranks take the single-device branch.
    for rank, results in each_rank(checks, "agreement"):
        outcome = results[case]
        assert outcome["verdict"] == "exact", (rank, outcome)
        assert DATA_BRANCHES[case] in outcome["explain"], outcome["explain"]
        assert "graph 1 " in outcome["explain"], outcome["explain"]  # the break split the step
