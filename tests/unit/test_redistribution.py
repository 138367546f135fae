"""Ops that mix tokens outside SDPA, made exact by redistribution (Note [Redistribution]): each model equals
one device on every rank (ranks simulated in one process, ``tests/unit/sp_graphs.py``), and the moves that
make it so are the ones ``explain()`` lists. Models: ``tests/distributed/mixer_modules.py``; the same
families through Lightning on 2 processes, with HF models, are in the zoo (``tests/zoo``)."""

from __future__ import annotations

import operator

import pytest
import torch

from benchmarks.common import grad_rel_err, rel_err
from lightning_autosp.compiler.fx_utils import eliminate_dead_code
from tests.distributed import mixer_modules as mixers
from tests.distributed.modules import VOCAB
from tests.unit.sp_graphs import simulate_step, single_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

LENGTH = 25  # odd: shards of 13 and 12
# model -> a fragment of explain() every run must show (the move or rewrite that makes it exact)
EXACT = {
    "multihead_attention": (mixers.MultiheadAttentionLM, "nn.MultiheadAttention calls as SDPA"),
    "transformer_encoder": (mixers.TransformerEncoderLM, "nn.MultiheadAttention calls as SDPA"),
    "alibi_per_head_mask": (mixers.AlibiGPT, "attention nodes: 2"),
    # its depthwise convolution meets shards again at once: a window (Note [Windows or blocks])
    "hybrid_linear_attention": (mixers.HybridLM, "-> window of 3 positions before and 0 after for conv1d"),
    "written_attention": (mixers.WrittenAttentionGPT, "-> split(1, whole sequence in 2) for matmul"),
    "checkpointed_blocks": (mixers.CheckpointedGPT, "activation checkpointing was replaced by SAC"),
    "meta_llama_idioms": (mixers.MetaLlamaBlockLM, "attention nodes: 1"),
    "mean_pool_classifier": (lambda: mixers.PooledClassifier("mean"), "partial -> replicate for linear"),
    "last_token_classifier": (lambda: mixers.PooledClassifier("last"), "partial -> replicate for linear"),
    "last_token_reward_model": (lambda: mixers.PooledClassifier("last", classes=1), "partial -> replicate"),
}


def batch(length: int = LENGTH) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (2, length), generator=generator)
    return {"input_ids": ids, "label": torch.tensor([1, 2])}


def assert_exact(module: torch.nn.Module, sample: dict, world: int = 2):
    loss, grads = single_device(module, sample)
    simulated = simulate_step(module, sample, world)
    assert max(rel_err(rank_loss, loss) for rank_loss in simulated.losses) <= 1e-5
    assert grad_rel_err(simulated.grads, grads) <= 1e-4
    return simulated


@pytest.mark.parametrize("name", list(EXACT))
def test_token_mixers_are_exact(name: str) -> None:
    build, explained = EXACT[name]
    torch.manual_seed(0)
    simulated = assert_exact(build(), batch())
    lines = "\n".join(simulated.reports[0].lines())
    assert explained in lines, lines


def test_a_running_count_over_tokens_is_refused() -> None:
    """An MoE with capacity counts each expert's tokens in order: no layout keeps that exact."""
    torch.manual_seed(0)
    with pytest.raises(NotImplementedError, match=r"cumsum at .*mixer_modules\.py:\d+ .*flattened together"):
        simulate_step(mixers.CapacityMoELM(), batch(), 2)


def test_used_attention_weights_are_refused_with_the_fix() -> None:
    class WeightsLM(mixers.MultiheadAttentionLM):
        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            h = self.embed(batch["input_ids"])
            out, weights = self.attns[0](h, h, h)
            return out.sum() + weights.sum()

    with pytest.raises(NotImplementedError, match="Call it with need_weights=False"):
        simulate_step(WeightsLM(), batch(), 2)


class SplitTailLM(mixers.MultiheadAttentionLM):
    """transformers' Mamba-2 scan (5.25): the last ``keep`` tokens split off to be scanned one at a time for
    a cache's states, none in training."""

    def __init__(self, keep: int) -> None:
        super().__init__(layers=1)
        self.keep = keep

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        x = self.embed(ids)
        keep = min(self.keep, x.shape[1])
        body, tail = torch.tensor_split(x, [x.shape[1] - keep], dim=1)
        pieces = [body.cumsum(-1)]
        pieces += [tail[:, i : i + 1] for i in range(keep)]
        return mixers.causal_lm_loss(self.head(torch.cat(pieces, dim=1)), ids)


def test_a_split_at_the_sequences_end_is_exact_and_one_inside_it_refused() -> None:
    torch.manual_seed(0)
    assert_exact(SplitTailLM(keep=0), batch())
    with pytest.raises(NotImplementedError, match=r"tensor_split at .*splits the sequence into pieces"):
        simulate_step(SplitTailLM(keep=2), batch(), 2)


def test_dead_code_elimination_keeps_in_place_writes() -> None:
    """``keys[..., :d].copy_(k)`` has no users but fills ``keys``: FX's own elimination drops it."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    buffer = graph.call_method("new_empty", (x, 4))
    view = graph.call_function(operator.getitem, (buffer, (Ellipsis, slice(0, 2))))
    graph.call_method("copy_", (view, x))
    graph.output(buffer)
    eliminate_dead_code(graph)
    assert [n.target for n in graph.nodes if n.op == "call_method"] == ["new_empty", "copy_"]


def test_a_branch_on_the_length_is_named_first() -> None:
    """The branch is why anything else looks wrong at this rank's length: it leads the refusal."""
    from lightning_autosp.data import SequenceShard
    from tests.unit.sp_graphs import pass_on

    def step(x):
        if x.size(1) > 12:  # 12 tokens on this rank, 24 in the sequence
            x = 2 * x
        return torch.cat([x, x.flip(-1)], dim=1).sum()  # two activations joined along the sequence

    shard = SequenceShard.balanced(24, 2, 0)
    x = torch.randn(2, shard.local_len, 8, requires_grad=True)
    with pytest.raises(NotImplementedError) as refusal:
        pass_on(step, shard, x, sharded={0: 1})
    reasons = [line for line in str(refusal.value).splitlines() if line.startswith("- ")]
    assert "branched on the sequence length" in reasons[0], reasons
    assert any("concatenates along the sequence" in line for line in reasons[1:]), reasons


# --------------------------------------------------------------------------------------------------
# the rules, on small graphs


def _pass(step, *args, sharded):
    from lightning_autosp.data import SequenceShard
    from tests.unit.sp_graphs import pass_on

    return pass_on(step, SequenceShard.balanced(24, 2, 1), *args, sharded=sharded)


def test_einsum_per_token_sum_over_tokens_and_token_pairs() -> None:
    """Per token: no move; summed over tokens: a partial sum, all-reduced; tokens against tokens: the
    whole sequence for a block of heads."""
    k, v = torch.randn(2, 4, 12, 8, requires_grad=True), torch.randn(2, 4, 12, 8, requires_grad=True)

    def per_token(k, v):
        return torch.einsum("bhtd,bhte->bhtde", k, v).sum()

    def over_tokens(k, v):
        return torch.einsum("bhtd,bhte->bhde", k, v).exp().sum()

    def token_pairs(k, v):
        return torch.einsum("bhtd,bhsd->bhts", k, v).softmax(-1).sum()

    lines = {
        f.__name__: _pass(f, k, v, sharded={0: 2, 1: 2})[1].redistributions
        for f in (per_token, over_tokens, token_pairs)
    }
    assert [line.split(" for ")[0] for line in lines["per_token"]] == ["sum_1 partial -> replicate"]
    assert "einsum partial -> replicate for exp" in lines["over_tokens"][0]
    assert [line.split(" for ")[0] for line in lines["token_pairs"][:2]] == [
        "l_k_ shard(2) -> split(1, whole sequence in 2)",
        "l_v_ shard(2) -> split(1, whole sequence in 2)",
    ]


def test_a_grouped_convolution_runs_its_groups_blocks() -> None:
    conv = torch.nn.Conv1d(8, 8, 3, groups=4, padding=2)
    x = torch.randn(2, 8, 12, requires_grad=True)
    gm, report, _ = _pass(lambda x: conv(x)[..., : x.size(2)].sum(), x, sharded={0: 2})
    (convolution,) = [n for n in gm.graph.nodes if "conv1d" in str(n.target)]
    assert convolution.args[-1] == 2  # 4 groups over 2 ranks
    assert convolution.args[1].target is torch.narrow  # this rank's block of the weight's out channels


def test_a_grouped_convolution_takes_the_layout_with_fewer_collectives() -> None:
    """Note [Windows or blocks]: back to shards at once, a window (one collective, not two); feeding a
    running sum over the sequence, which needs the whole sequence anyway, a block of its groups."""
    conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2)
    x = torch.randn(2, 8, 12, requires_grad=True)

    def between_projections(x):
        return (conv(x)[..., : x.size(2)] + x).sum()

    def feeding_a_scan(x):
        return conv(x)[..., : x.size(2)].cumsum(2).sum()

    reports = {f.__name__: _pass(f, x, sharded={0: 2})[1] for f in (between_projections, feeding_a_scan)}
    windowed, blocked = (
        "\n".join(reports[name].lines()) for name in ("between_projections", "feeding_a_scan")
    )
    # with the loss's all-reduce: a window and it, against an all-to-all there, one back and it
    assert "on windows: 2 collectives (132 bytes on this rank) on windows, 3 (1540 bytes)" in windowed, (
        windowed
    )
    assert "on blocks of groups: 3 collectives (900 bytes on this rank) on windows, 2 (772 bytes)" in blocked
    assert "l_x_ shard(2) -> window of 2 positions before and 0 after for conv1d" in windowed, windowed
    assert "split(" not in windowed, windowed
    assert "l_x_ shard(2) -> split(1, whole sequence in 2) for conv1d" in blocked, blocked
    assert "-> window" not in blocked, blocked


def test_rows_of_a_token_permutation_are_not_mixed() -> None:
    """A running count over sorted slots (an expert's capacity) relates other tokens' rows: refused."""

    def dispatch(x, router):
        expert = (x @ router).argmax(-1).reshape(-1)  # (B * T,): this rank's tokens' experts
        _, order = torch.sort(expert)
        rows = x.reshape(-1, x.size(-1))[order]
        return rows.cumsum(0).sum()

    x, router = torch.randn(2, 12, 8, requires_grad=True), torch.randn(8, 4)
    with pytest.raises(NotImplementedError, match=r"running cumsum across rows of this rank's tokens"):
        _pass(dispatch, x, router, sharded={0: 1})


def test_mixtral_keeps_each_ranks_tokens_through_its_experts() -> None:
    from tests.distributed.user_modules import HFModule

    torch.manual_seed(0)
    module = HFModule("mixtral", num_local_experts=4, num_experts_per_tok=2)
    simulated = assert_exact(module, batch())
    assert not simulated.reports[0].redistributions  # no collective: the dispatch stays on each rank


@pytest.mark.parametrize(
    ("kind", "world", "length"),
    [
        ("same", 2, 25),
        ("same_even", 2, 24),
        ("dilated", 4, 25),
        ("causal", 2, 25),
        ("valid", 2, 25),
        ("spectrogram", 2, 25),
        ("wide", 4, 26),  # shards of 7, 7, 6, 6: 8 positions either side reach two ranks away
    ],
)
def test_a_sequence_convolution_reads_its_neighbours_rows(kind: str, world: int, length: int) -> None:
    """Note [Windows of the sequence]: exact at uneven shards, with the window listed by explain()."""
    torch.manual_seed(0)
    simulated = assert_exact(mixers.ConvolutionLM(kind), batch(length), world)
    lines = "\n".join(simulated.reports[0].lines())
    assert "-> window of" in lines and "all-to-all of the neighbours' boundary rows" in lines, lines


@pytest.mark.parametrize(("world", "length", "before"), [(2, 25, 2), (4, 26, 2), (4, 26, 9)])
def test_tokens_joined_to_the_sequence_shift_it_across_the_ranks(
    world: int, length: int, before: int
) -> None:
    """Note [Windows of the sequence]: the joined sequence is owned as any longer one; attention, positions
    and the slice back to the batch's positions follow its length. 9 tokens before shards of 7 and 6: the
    first rank's positions are all joined tokens, the second's start with some, and the slice back
    reaches two ranks ahead (a window too, where it was refused)."""
    torch.manual_seed(0)
    simulated = assert_exact(mixers.JoinedTokensLM(before=before), batch(length), world)
    lines = "\n".join(simulated.reports[0].lines())
    assert f"joined with {before} tokens before and 1 after" in lines, lines


def test_a_strided_convolution_over_the_sequence_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(NotImplementedError, match=r"conv1d at .*mixer_modules\.py.*stride 2 along it"):
        simulate_step(mixers.ConvolutionLM("strided"), batch(24), 2)
