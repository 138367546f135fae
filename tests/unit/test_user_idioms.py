"""Training steps as users write them (tests/distributed/user_modules.py): each idiom the SP pass proves
exact equals one device on every rank; each it cannot prove is refused, naming the user's line and a fix.

Ranks are simulated in one process (tests/unit/sp_graphs.py); tests/distributed/test_user_idioms.py runs
the same modules through Lightning on 2 processes.
"""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.common import grad_rel_err, rel_err
from tests.distributed.modules import VOCAB
from tests.distributed.user_modules import (
    HFModule,
    LitGPTModule,
    LossGPT,
    ReadmeLlama,
    SequenceIdiomGPT,
    SlicedTableGPT,
)
from tests.unit.sp_graphs import simulate_step, single_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
EXACT = {
    # README's usage example at tiny sizes: a default config (its KV cache appends to an empty tensor)
    "readme_llama": lambda: ReadmeLlama(),
    # position tables sliced by the length: learned (minGPT), a rope cache (litgpt, freqs_cis[:seqlen])
    "learned_table": lambda: SlicedTableGPT("learned"),
    "rope_table": lambda: SlicedTableGPT("rope"),
    "litgpt": lambda: LitGPTModule(),
    # positions from a cumsum of the attention mask
    "opt": lambda: HFModule("opt", ffn_dim=64, word_embed_proj_dim=32, **NO_DROPOUT),
    # rope scaled past max_position_embeddings statically (the fix docs give for dynamic-NTK rope's refusal)
    "yarn_rope": lambda: HFModule(
        "llama",
        max_position_embeddings=16,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 2.0,
            "rope_theta": 1e4,
            "original_max_position_embeddings": 8,
        },
    ),
    # a sliding window equal to the shard length (12 of 24 tokens): not taken for the causal mask
    "mistral_window_12": lambda: HFModule("mistral", sliding_window=12),
    # losses written by hand
    "nll_of_log_softmax": lambda: LossGPT("nll"),
    "sum_over_count": lambda: LossGPT("sum_over_count"),
    "rolled_labels": lambda: LossGPT("roll"),
    "mean_of_per_token_losses": lambda: LossGPT("mean_none"),
    # ops that mix tokens outside attention, made exact by redistribution (Note [Redistribution])
    "hand_written_attention": lambda: SequenceIdiomGPT("hand_written_attention"),  # split over the batch
    "sort_over_sequence": lambda: SequenceIdiomGPT("sort_over_sequence"),  # split over the channels
    "cumsum_of_activations": lambda: SequenceIdiomGPT("cumsum_of_activations"),
    "pool_last_token": lambda: SequenceIdiomGPT("pool_last_token"),  # picked where it lives, all-reduced
    # a causal convolution over the sequence: a window with the previous rank's last 2 positions
    "conv_over_sequence": lambda: SequenceIdiomGPT("conv_over_sequence"),
    # a learned token joined before the sequence: every position moves one rank boundary's worth
    "insert_token": lambda: SequenceIdiomGPT("insert_token"),
    # aten.slice with a step along the sequence (once taken as a plain slice): moved to a block of channels
    "every_other_token": lambda: SequenceIdiomGPT("every_other_token"),
    # Qwen3.5's gated norm: tokens flattened between the batch and the heads, then viewed back
    "gated_norm_over_heads": lambda: SequenceIdiomGPT("gated_norm_over_heads"),
}
REFUSED = {
    "branch_on_length": (None, "branched on the sequence length", "trace_length='whole'"),
    "chunked_scan": (None, "branched on the sequence length", "trace_length='whole'"),
    "associative_scan": (None, "branched on the sequence length", "trace_length='whole'"),
    "heads_before_tokens": (None, "in a way that mixes it with another dim", "Keep the sequence dim whole"),
    "rows_flattened_two_ways": (None, "flattened with different dims", "Flatten both values"),
}
# Python that computes with the length: exact when traced at the whole sequence's length (Note [Tracing at
# the whole sequence's length] in compiler/whole_sequence.py), refused at the shard's (REFUSED above)
WHOLE = ["branch_on_length", "chunked_scan", "associative_scan", "truncate_to_fixed_length"]


def batch_of(length: int, ignored_tail: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (2, length), generator=generator)
    labels = ids.clone()
    labels[:, length - ignored_tail :] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("length", [24, 25])
@pytest.mark.parametrize("idiom", list(EXACT))
def test_idiom_is_exact(idiom: str, length: int) -> None:
    torch.manual_seed(0)
    module = EXACT[idiom]()
    batch = batch_of(length)
    loss, grads = single_device(module, batch)
    simulated = simulate_step(module, batch, 2)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4


@pytest.mark.parametrize("length", [13, 24, 25])
@pytest.mark.parametrize("idiom", WHOLE)
def test_python_on_the_length_is_exact_traced_whole(idiom: str, length: int) -> None:
    torch.manual_seed(0)
    module = SequenceIdiomGPT(idiom)
    batch = batch_of(length)
    loss, grads = single_device(module, batch)
    simulated = simulate_step(module, batch, 2, whole=True)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4
    assert all("whole sequence's length" in report.one_length for report in simulated.reports)


@pytest.mark.parametrize("idiom", list(REFUSED))
def test_idiom_is_refused_with_the_users_line(idiom: str) -> None:
    torch.manual_seed(0)
    module = SequenceIdiomGPT(idiom)
    op, reason, fix = REFUSED[idiom]
    with pytest.raises(NotImplementedError) as refusal:
        simulate_step(module, batch_of(24), 2)
    message = str(refusal.value)
    assert reason in message and fix in message, message
    if op is not None:  # the op, in the user's file, at the line that calls it
        assert re.search(rf"- {op} at .*user_modules\.py:\d+ in training_step", message), message
    else:  # a branch: Dynamo's record of where the user's code took it
        assert "user_modules.py" in message, message


@pytest.mark.parametrize("length", [40, 41])
def test_a_sequence_truncated_to_a_fixed_length_is_exact_traced_at_the_shard(length: int) -> None:
    """Both ranks' shards are longer than 16 tokens, so the shard trace takes the one device's branch; the
    last 16 tokens (on one rank at 40, across the cut at 41) are then a sequence no length symbol marks,
    whose views count elements instead (Note [Views of flattened tokens])."""
    torch.manual_seed(0)
    module = SequenceIdiomGPT("truncate_to_fixed_length")
    batch = batch_of(length)
    loss, grads = single_device(module, batch)
    simulated = simulate_step(module, batch, 2)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4
