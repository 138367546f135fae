"""The retrieval task needs attention across the shard boundary, and ``retrieval_demo.py`` runs.

``RetrievalTask`` puts the key in the first quarter of the sequence and the query at the end, so with 2
sequence shards the key is on rank 0 and the query on rank 1. Sequence parallelism that attended only
within each rank's shard would still train without an error, but could not learn the task. Here the
same tiny GPT, from the same initial weights, trains in one process twice: once with ordinary causal
attention and once with attention restricted to each half of the sequence (block-diagonal causal
attention: what shard-local attention would compute). The shard-local model stays at chance, because
the answer is not in its half of the sequence; the full model learns the lookup. Sizes: 32 tokens, 16
ids, 150 steps of 64 sequences; the full model was at >= 99% held-out accuracy by step 150 for four
seeds, and both runs together take about 5 s on 2 idle cores.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.data import RetrievalTask
from examples.models import IGNORE_INDEX, CausalSelfAttention, TinyGPT
from examples.retrieval_demo import answer_accuracy, stack

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, VOCAB, BATCH, STEPS, SHARDS = 32, 16, 64, 150, 2
CHANCE = 1 / (VOCAB - 1)  # answers are drawn from every id but the marker


class ShardLocalAttention(CausalSelfAttention):
    """``CausalSelfAttention`` within each of ``shards`` equal slices of the sequence, as each rank of a
    sequence-parallel group would compute it on its own shard without the all-to-alls."""

    shards = SHARDS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        # Projections act per token, so running every shard as its own sequence is exactly block-diagonal
        # causal attention (and keeps SDPA's fast is_causal path).
        return super().forward(x.reshape(B * self.shards, T // self.shards, C)).view(B, T, C)


def make_model(shard_local: bool) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ_LEN, n_layer=2, n_head=4, n_embd=64)
    if shard_local:
        # Same parameters and initial values; only the attention pattern changes.
        for block in model.blocks:
            block.attn.__class__ = ShardLocalAttention
    return model


def answer_loss(model: TinyGPT, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``GPTModule``'s loss: shifted next-token cross-entropy, where only the answer is labelled."""
    logits = model(input_ids)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


def train(shard_local: bool) -> tuple[float, float]:
    """Held-out answer accuracy and loss after ``STEPS`` AdamW steps."""
    model = make_model(shard_local)
    train_ids, train_labels = stack(RetrievalTask(STEPS * BATCH, SEQ_LEN, VOCAB, seed=0))
    held_ids, held_labels = stack(RetrievalTask(512, SEQ_LEN, VOCAB, seed=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        loss = answer_loss(model, train_ids[batch], train_labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        held_loss = answer_loss(model, held_ids, held_labels).item()
    return answer_accuracy(model, held_ids, held_labels), held_loss


def test_the_key_is_on_rank_0_and_the_query_on_rank_1() -> None:
    sample = RetrievalTask(200, SEQ_LEN, VOCAB, seed=0)
    half = SEQ_LEN // SHARDS
    for i in range(len(sample)):
        ids, labels = sample[i]["input_ids"], sample[i]["labels"]
        (keys,) = torch.nonzero(ids[:-2] == sample.marker, as_tuple=True)
        assert len(keys) == 1 and keys.item() + 1 < half  # key and value on rank 0
        assert ids[keys.item() + 1] == labels[-1]


def test_shard_local_model_cannot_see_the_other_shard() -> None:
    half = SEQ_LEN // SHARDS
    ids = torch.randint(0, VOCAB - 1, (4, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, :half] = (changed[:, :half] + 1) % (VOCAB - 1)  # a different first half (key and value)
    local, full = make_model(shard_local=True), make_model(shard_local=False)
    with torch.no_grad():
        torch.testing.assert_close(local(changed)[:, half:], local(ids)[:, half:])
        assert not torch.allclose(full(changed)[:, half:], full(ids)[:, half:])
        # Within a shard both compute the same causal attention.
        torch.testing.assert_close(local(ids)[:, :half], full(ids)[:, :half])


@pytest.fixture
def flush_denormals() -> Iterator[None]:
    # The shard-local model's gradients shrink into subnormal floats, which made its 150 CPU steps take
    # 30 s instead of 2 s.
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.slow
def test_shard_local_attention_cannot_solve_retrieval_full_attention_can(flush_denormals: None) -> None:
    local_accuracy, local_loss = train(shard_local=True)
    full_accuracy, full_loss = train(shard_local=False)
    # Shard-local: chance accuracy (1/15 = 0.067, with a standard deviation of 0.011 over 512 samples;
    # the bound is 7 of them above) and the loss of a uniform guess, ln(15) = 2.71.
    assert local_accuracy < CHANCE + 0.08, local_accuracy
    assert local_loss > math.log(VOCAB - 1) - 0.1, local_loss
    # Full attention: the lookup is learned.
    assert full_accuracy > 0.9, full_accuracy
    assert full_loss < 0.5 < local_loss


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_retrieval_demo_runs(tmp_path: Path) -> None:
    """Smoke test of the demo script (2 processes, a few steps); its full run is in examples/README.md."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    # 20 tokens per rank: not the head size (16), which the SP pass would refuse as ambiguous.
    args = ["--max-steps=4", "--eval-every=2", "--eval-samples=64", "--seq-len=40", "--batch-size=8"]
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "retrieval_demo.py"), *args, f"--log-dir={tmp_path}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, many times what the run takes
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "held-out answer accuracy" in output and "after 4 steps" in output, output[-3000:]
    assert "rank 0 held tokens 0-19" in output  # 40 tokens: 20 per rank
