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
# A hang guard for each torchrun launch, several times what one takes on 2 idle cores; the tests' own
# timeouts leave a minute more, so that a hung job is killed and its output shown.
PARITY_HANG_GUARD_S = 1200

TWO_RANK_CASES = [
    "llama_gqa",
    "llama_1kv",
    "llama_gqa_no_sac",
    "llama_gqa_auto_sac",
    "llama_len61",
    "gpt_shift",
    "gpt_shift_no_sac",
    "gpt_triu_mask",
    "gpt_window_mask",
    "gpt_graph_break",
    "gpt_ddp_buckets",
    "llama_ddp_buckets",
    "gpt_len61",
]
FOUR_RANK_CASES = ["dp2_sp2", "dp2_sp2_llama"]
# sp=4 over 2 q heads: Ulysses x ring (ulysses_degree="auto": 2 x 2; 1: all ring), zigzag and contiguous
RING_CASES = [
    "ring_gpt_contiguous",
    "ring_gpt_zigzag",
    "ring_gpt_window_all_ring",
    "ring_llama_zigzag",
    "ring_llama_contiguous_all_ring",
    "ring_llama_zigzag_fsdp",
]
# Built on the meta device, sharded there, each rank's shard materialised (4 ranks, dp=2 x sp=2)
META_INIT_CASES = ["fsdp_meta_dp2_sp2", "fsdp_meta_dp2_sp2_per_step"]
# data_parallel="fsdp" (2 ranks; dp=2 x sp=2 runs in tests/distributed/test_multinode.py)
FSDP_CASES = ["fsdp_gpt", "fsdp_gpt_per_step", "fsdp_llama", "fsdp_gpt_inductor", "fsdp_user_units"]
FSDP_CASES += ["fsdp_gpt_per_step_offload"]
# Chunked LM head + cross-entropy, 5 tokens a chunk (every other case chunks too, in one chunk)
CHUNKED_LOSS_CASES = ["gpt_chunked_loss", "llama_chunked_loss"]
# Packed rows of 3 documents (position_ids restart); flash-attn (its ops on CPU: tests/flash_stand_in.py)
PACKED_CASES = ["llama_packed", "gpt_document_mask", "llama_packed_fsdp"]
FLASH_CASES = ["flash_gqa_window", "flash_varlen_packed", "flash_gqa_window_fsdp"]


def launch(ranks: int, cases: list[str], out: Path, timeout: int) -> dict[int, dict]:
    code, stderr, _ = torchrun(ranks, WORKER, "--out", str(out), "--cases", *cases, timeout=timeout)
    assert code == 0, stderr[-6000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict[int, dict]:
    return launch(
        2,
        [
            *TWO_RANK_CASES,
            "gpt_graph_break_in_loop",
            "gpt_sp_pass_off",
            "ddp_sp1",
            "fsdp_sp1",
            "llama_bf16_mixed",
            "fsdp_llama_bf16_mixed",
            *FSDP_CASES,
            "fsdp_user_blocks",
            "fsdp_user_head_unit",
            *CHUNKED_LOSS_CASES,
            "gpt_chunked_loss_broken",
            "gpt_len61_activation_budget",
            "gpt_len61_longest_offload",
            *PACKED_CASES,
            *FLASH_CASES,
        ],
        tmp_path_factory.mktemp("p2"),
        PARITY_HANG_GUARD_S,
    )


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory) -> dict[int, dict]:
    cases = [*FOUR_RANK_CASES, *RING_CASES, "ring_gpt_zigzag_ring_off", *META_INIT_CASES]
    return launch(4, cases, tmp_path_factory.mktemp("p4"), PARITY_HANG_GUARD_S)


def assert_parity(results: dict[int, dict], case: str, *, sequence_parallel: bool = True) -> None:
    for rank, per_case in results.items():
        result = per_case[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        # the SP pass moved something between ranks: attention's all-to-alls, or another redistribution
        moved = result["all_to_alls"] > 0 or "redistributed (value" in result["explain"]
        assert moved == sequence_parallel, result["explain"]
        assert result["checkpoint_keys_match"]
        assert not result["missing_grads"]
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_parity_two_ranks(two_rank_results, case):
    assert_parity(two_rank_results, case)


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_parity_dp2_sp2(four_rank_results, case):
    assert_parity(four_rank_results, case)


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", META_INIT_CASES)
def test_parity_fsdp_from_the_meta_device(four_rank_results, case):
    assert_parity(four_rank_results, case)
    assert all(per_case[case]["sharded"] for per_case in four_rank_results.values())


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", FSDP_CASES)
def test_parity_fsdp(two_rank_results, case):
    # Gradients are gathered from the DTensor shards; the scaling must equal DDP's exactly.
    assert_parity(two_rank_results, case)
    assert all(per_case[case]["sharded"] for per_case in two_rank_results.values())


@pytest.mark.timeout(1260)
def test_fsdp_offloads_parameter_shards_with_fsdp2s_cpu_offload_policy(two_rank_results):
    # offload_parameters=True: the unit's shards (and so its gradients' and AdamW's state) live in host
    # memory; on CPU that moves nothing, so the control is the policy FSDP2 runs with.
    for per_case in two_rank_results.values():
        assert per_case["fsdp_gpt_per_step_offload"]["offload_policy"] == "CPUOffloadPolicy"
        assert per_case["fsdp_gpt_per_step"]["offload_policy"] == "OffloadPolicy"


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", ["fsdp_gpt", "fsdp_gpt_per_step"])
def test_fsdp_steps_compile_as_one_graph_so_the_loss_is_chunked(two_rank_results, case):
    # The LM head (in the model) and the loss (in training_step) meet in one graph: per_use gathers are
    # traced ops; per_step runs FSDP2's hooks (graph breaks) around the step, not at the model's call.
    for per_case in two_rank_results.values():
        assert per_case[case]["graphs"] == 1
        assert "chunk(s) of 5" in per_case[case]["explain"], per_case[case]["explain"]


@pytest.mark.timeout(1260)
def test_fsdp_per_use_gathers_parameters_again_in_backward_instead_of_saving_them(two_rank_results):
    # Note [Gathered parameters in backward]: of the GPT's 21 parameters, backward re-gathers the 19 its
    # gradients need: not the two embedding tables (their gradients need only the ids; the block input
    # they make is saved instead of rebuilt from a re-gathered table). Saved activations are those of
    # FSDP2 gathering the module around the step, plus that block input; saving the gathered weights
    # instead keeps the whole model alive from forward to backward (5x the bytes here).
    for per_case in two_rank_results.values():
        per_use, per_step = per_case["fsdp_gpt"], per_case["fsdp_gpt_per_step"]
        assert per_use["backward_parameter_gathers"] == 19, per_use["explain"]
        assert per_step["backward_parameter_gathers"] == 0
        assert per_use["saved_bytes"] <= per_step["saved_bytes"] * 1.2, (per_use, per_step)


@pytest.mark.timeout(1260)
def test_fsdp_gathers_matmul_weights_in_autocasts_dtype(two_rank_results):
    # Autocast's cast moves in front of the all-gather (exact): the 14 projections and the LM head of
    # the 2-layer Llama gather in bf16; its norms (used in fp32) and embedding do not, nor anything in fp32.
    for per_case in two_rank_results.values():
        assert per_case["fsdp_llama_bf16_mixed"]["gathers_in_compute_dtype"] == 15
        assert per_case["fsdp_llama"]["gathers_in_compute_dtype"] == 0


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", ["fsdp_user_blocks", "fsdp_user_head_unit"])
def test_fsdp_units_that_run_eagerly_are_an_error(two_rank_results, case):
    # FSDP2's hooks are graph breaks; inside the loop over layers Dynamo skips the frame, and torch's own
    # nn.Linear sharded as the LM head runs eagerly through the hooks: either way the next compiled graph
    # refuses what ran outside it (sequence data computed without SP), on every rank.
    for per_case in two_rank_results.values():
        assert "computed outside the compiled graphs" in per_case[case]["error"]


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", CHUNKED_LOSS_CASES)
def test_parity_chunked_loss(two_rank_results, case):
    assert_parity(two_rank_results, case)
    for per_case in two_rank_results.values():
        assert "chunk(s) of 5" in per_case[case]["explain"], per_case[case]["explain"]


@pytest.mark.timeout(1260)
def test_parity_breaks_when_the_chunked_loss_drops_a_chunk(two_rank_results):
    # Negative control: the parity check sees what the chunked op computes. The dropped chunk's rows of
    # the hidden states' gradient are never written (the op allocates it empty), so they hold whatever
    # the memory held, NaN included: "not within tolerance" is what assert_parity would see fail.
    result = two_rank_results[0]["gpt_chunked_loss_broken"]
    assert "error" not in result, result.get("error")
    assert not result["loss_rel_err"] <= 1e-3 and not result["grad_rel_err"] <= 1e-2, result


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", RING_CASES)
def test_parity_ulysses_x_ring(four_rank_results, case):
    assert_parity(four_rank_results, case)
    for per_case in four_rank_results.values():
        assert per_case[case]["ring_attentions"] == 2, per_case[case]["explain"]  # both layers


@pytest.mark.timeout(1260)
def test_parity_breaks_without_ring_attention(four_rank_results):
    # Negative control: the same zigzag layout and all-to-alls, but each ring rank attends to its own
    # tokens only (no K/V passed around the ring); the parity check must notice.
    result = four_rank_results[0]["ring_gpt_zigzag_ring_off"]
    assert "error" not in result, result.get("error")
    assert result["loss_rel_err"] > 1e-3 and result["grad_rel_err"] > 1e-2


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", ["llama_bf16_mixed", "fsdp_llama_bf16_mixed"])
def test_bf16_mixed_parity_within_bf16_rounding(two_rank_results, case):
    # Against a single-device run under the same CPU bf16 autocast; bf16 has 8 bits of mantissa (2**-7).
    for rank, per_case in two_rank_results.items():
        result = per_case[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["all_to_alls"] > 0
        assert result["loss_rel_err"] <= 1e-2 and result["grad_rel_err"] <= 3e-2, (rank, result)


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", ["ddp_sp1", "fsdp_sp1"])
def test_sp_size_1_is_plain_data_parallel(two_rank_results, case):
    assert_parity(two_rank_results, case, sequence_parallel=False)


@pytest.mark.timeout(1260)
def test_ddp_buckets_split_the_graph(two_rank_results):
    # The bucketed case must really reach the backend as several sub-graphs, or it tests nothing.
    assert two_rank_results[0]["gpt_ddp_buckets"]["graphs"] > 2
    assert two_rank_results[0]["llama_ddp_buckets"]["graphs"] > 2


@pytest.mark.timeout(1260)
def test_causal_mask_crosses_sub_graphs_as_a_marker_not_an_s_by_s_tensor(two_rank_results):
    # The model builds its causal mask in the first bucket's graph; the later graphs must get is_causal,
    # not [S, S]. A mask from per-token data (HF given a tokenizer's attention_mask) is rebuilt whole.
    for per_case in two_rank_results.values():
        explain = per_case["gpt_ddp_buckets"]["explain"]
        assert "causal, handed on as a tag" in explain
        assert "causal mask from the previous graph -> is_causal=True" in explain
        assert "rebuilt for the whole sequence" not in explain
        assert "handed on rebuilt for the whole sequence" in per_case["llama_ddp_buckets"]["explain"]


@pytest.mark.timeout(1260)
def test_parity_breaks_without_the_sp_pass(two_rank_results):
    # Negative control: same harness, passes disabled; the parity check must notice.
    result = two_rank_results[0]["gpt_sp_pass_off"]
    assert "error" not in result, result.get("error")
    assert result["all_to_alls"] == 0
    assert result["loss_rel_err"] > 1e-3 and result["grad_rel_err"] > 1e-2


@pytest.mark.timeout(1260)
def test_graph_break_in_a_loop_is_an_error_not_a_silent_fallback(two_rank_results):
    # Dynamo runs the frame with the loop eagerly (no SP); the graph after it refuses what that computed.
    for per_case in two_rank_results.values():
        assert "computed outside the compiled graphs" in per_case["gpt_graph_break_in_loop"]["error"]


# The defaults users get (Inductor + SAC); batch 1 at 61 tokens made Inductor order the all-to-alls of
# dq, dk and dv differently on the two ranks (Note [Collective order] in compiler/partition/ordering.py).
INDUCTOR_CASES = [
    "gpt_inductor",
    "gpt_len61_b1_inductor",
    "llama_len61_b1_inductor_tiled",
    "llama_len61_b1_inductor_longest",
]


@pytest.fixture(scope="module")
def inductor_results(tmp_path_factory) -> dict[int, dict]:
    return launch(2, INDUCTOR_CASES, tmp_path_factory.mktemp("inductor"), PARITY_HANG_GUARD_S)


@pytest.mark.inductor
@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", INDUCTOR_CASES)
def test_parity_inductor_end_to_end(inductor_results, case):
    assert_parity(inductor_results, case)
    tiled = {rank: per_case[case]["tiled_regions"] for rank, per_case in inductor_results.items()}
    if case.endswith("_tiled"):  # the MLPs really ran over tiles of tokens, forward and backward
        assert all(n >= 4 for n in tiled.values()), tiled
    if case.endswith("_longest"):  # both layers rebuilt attention, and backward re-ran their all-to-alls
        for per_case in inductor_results.values():
            assert per_case[case]["layers_rebuilding_attention"] == 2, per_case[case]["explain"]
            assert per_case[case]["backward_collectives"] == 2 * 2 * 2 + 1, per_case[case]["explain"]


@pytest.mark.timeout(1260)
def test_an_activation_budget_sends_only_the_layers_it_needs(two_rank_results):
    """Note [Layers that recompute attention]: one of the two layers rebuilds attention, the other keeps
    SAC's saves; exact either way."""
    assert_parity(two_rank_results, "gpt_len61_activation_budget")
    for rank, per_case in two_rank_results.items():
        budget, sac = per_case["gpt_len61_activation_budget"], per_case["gpt_len61"]
        assert budget["layers_rebuilding_attention"] == 1, (rank, budget["explain"])
        # the sent layer's two all-to-alls, and the head's (the label shift's window, the loss's all-reduce)
        # when it is the last layer: this GPT has no final norm, so no saved block input cuts the head off
        added = budget["backward_collectives"] - sac["backward_collectives"]
        assert added >= 2 and f"+{added} collectives" in budget["explain"], (rank, budget["explain"])
        assert "budget 0.10 MiB: 1 of 2 layers rebuild attention" in budget["explain"]


@pytest.mark.timeout(1260)
def test_offloaded_layer_inputs_give_one_devices_numbers(two_rank_results):
    """Note [Activation offload]: with every layer rebuilt and its input copied to host and back, loss and
    gradients are one device's on ranks of 31 and 30 tokens, and explain() says what moved."""
    assert_parity(two_rank_results, "gpt_len61_longest_offload")
    for rank, per_case in two_rank_results.items():
        result = per_case["gpt_len61_longest_offload"]
        assert result["layers_rebuilding_attention"] == 2, (rank, result["explain"])
        assert "kept in host memory until backward" in result["explain"], (rank, result["explain"])


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", [*PACKED_CASES, *FLASH_CASES])
def test_parity_packed_documents_and_flash_attention(two_rank_results, case):
    assert_parity(two_rank_results, case)


@pytest.mark.timeout(1260)
@pytest.mark.parametrize("case", PACKED_CASES)
def test_attention_across_documents_would_fail_parity(two_rank_results, case):
    # Negative control: the same row with a plain causal mask (attention crossing documents) moves the
    # loss by far more than the parity tolerance, so parity above means the documents stayed apart.
    for per_case in two_rank_results.values():
        assert per_case[case]["cross_document_rel_diff"] > 10 * LOSS_TOLERANCE, per_case[case]
