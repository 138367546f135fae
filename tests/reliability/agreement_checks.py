"""Checks that the ranks of an sp group agree, run by ``checks_worker.py`` (2 ranks, sp=2); each case
records what every rank saw and then meets a barrier, so a rank left inside a collective shows.

- ``same_sample`` (Note [Ranks hold the same sample]): loaders that hand the two ranks different samples
  (an IterableDataset sharded by the global rank, ``use_distributed_sampler=False`` with a per-rank
  shuffle, a user's ``DistributedSampler`` over all ranks) must fail in ``batch_to_device``, naming the
  ranks; the same loaders sharded by the dp rank, and Lightning's own sampler, train. With
  ``check_samples=False`` the mismatched loader trains (silently wrong: the check is what stops it).
- ``agreement`` (Note [Ranks agree on their graphs]), each through ``lightning_autosp.tools.verify``: uneven
  shards compile the same signature on both ranks and are exact; a step that branches on
  ``torch.distributed.get_rank()`` compiles different graphs, which must raise the same error on every
  rank naming the first difference; graph breaks on data that differs between the shards (a token only
  in rank 1's half, the first token, only in rank 0's) take the single-device branch on every rank, since
  the SP pass computes their conditions over the whole sequence, and are exact.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_autosp import AutoSPStrategy, verify
from lightning_autosp.compiler import backend as backend_module
from tests.distributed.modules import VOCAB, GPTModule

# Short: a case that leaves a rank in a collective fails the next barrier instead of hanging the launch.
AGREEMENT_TIMEOUT = timedelta(seconds=120)


def _samples(count: int, seq_len: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (seq_len,), generator=generator)} for _ in range(count)]


def _fit(module: L.LightningModule, loader: Callable[[L.Trainer], DataLoader], **kwargs: Any) -> dict:
    """One step; the outcome (error, where it was raised, the strategy's explain()) on this rank."""
    torch._dynamo.reset()
    strategy_kwargs = {k: kwargs.pop(k) for k in ("check_samples",) if k in kwargs}
    strategy = AutoSPStrategy(sp_size=2, compiler="aot_eager", timeout=AGREEMENT_TIMEOUT, **strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    start = time.monotonic()
    try:
        trainer.fit(module, loader(trainer))
        outcome: dict[str, Any] = {"error": None, "explain": strategy.explain()}
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        where = " <- ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames[-8:]))
        outcome = {"error": f"{type(error).__name__}: {error}", "where": where}
    outcome["seconds"] = time.monotonic() - start
    try:  # a rank left inside a collective does not meet this barrier
        dist.barrier()
        outcome["in_step"] = True
    except Exception as error:
        outcome["in_step"] = False
        outcome["barrier_error"] = f"{type(error).__name__}: {error}"
    return outcome


# --------------------------------------------------------------------------------------------------
# same sample


class RankShardedStream(IterableDataset):
    """Every ``world``-th sample from ``rank`` on, as streaming datasets shard; ``shard_by`` gives
    (rank, world) when iteration starts."""

    def __init__(self, samples: list[dict], shard_by: Callable[[], tuple[int, int]]) -> None:
        self.samples, self.shard_by = samples, shard_by

    def __iter__(self) -> Iterator[dict]:
        rank, world = self.shard_by()
        yield from self.samples[rank::world]


def _by_global_rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def same_sample_cases() -> dict[str, tuple[Callable[[L.Trainer], DataLoader], dict]]:
    """name -> (the loader, given the trainer; Trainer/strategy options)."""
    samples = _samples(8, 24)

    def by_dp_rank(trainer: L.Trainer) -> Callable[[], tuple[int, int]]:
        return lambda: (trainer.strategy.dp_rank, trainer.strategy.dp_size)

    return {
        "iterable_by_global_rank": (lambda t: DataLoader(RankShardedStream(samples, _by_global_rank), 2), {}),
        "iterable_by_dp_rank": (lambda t: DataLoader(RankShardedStream(samples, by_dp_rank(t)), 2), {}),
        "no_distributed_sampler": (
            lambda t: DataLoader(
                samples, 2, shuffle=True, generator=torch.Generator().manual_seed(dist.get_rank())
            ),
            {"use_distributed_sampler": False},
        ),
        "sampler_over_all_ranks": (
            lambda t: DataLoader(samples, 2, sampler=DistributedSampler(samples, shuffle=False)),
            {},
        ),
        "lightning_sampler": (lambda t: DataLoader(samples, 2, shuffle=True), {}),
        "check_off": (
            lambda t: DataLoader(RankShardedStream(samples, _by_global_rank), 2),
            {"check_samples": False},
        ),
    }


def check_same_sample() -> dict:
    _set_pg_timeout(AGREEMENT_TIMEOUT)
    return {
        name: _fit(GPTModule(), loader, **kwargs) for name, (loader, kwargs) in same_sample_cases().items()
    }


# --------------------------------------------------------------------------------------------------
# same graphs


class BranchingGPT(GPTModule):
    """The tests' GPT, running the model a second time (one more attention per layer) when ``branch``
    says so: on rank 1 only (``rank``), when token 3 occurs anywhere (``any_token``: a graph break on
    data) or when the first token is 3 (``first_token``: one position, which lives on rank 0)."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(ids)
        if self.branch == "rank":
            again = torch.distributed.get_rank() == 1
        elif self.branch == "any_token":
            again = bool((ids == 3).any())
        else:
            again = bool(ids[0, 0] == 3)
        if again:
            logits = logits + 0.0 * self.model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class _SignatureRecorder:
    """Wraps the backend's ``agree``: each compiled graph's signature on this rank, in order."""

    def __init__(self) -> None:
        self.signatures: list[list[str]] = []
        self._agree = backend_module.agree

    def __call__(self, outcome: Any, group_name: str) -> None:
        self.signatures.append(
            list(outcome.signature) if outcome.error is None else [f"error: {outcome.error}"]
        )
        return self._agree(outcome, group_name)


def agreement_batch(token_3_at: int) -> dict[str, torch.Tensor]:
    """2 x 25 tokens (shards 0-12 and 13-24) with token 3 only at this position of sample 0: at 13 it is in
    rank 1's half only; at 0 it is the first token, which rank 1's shard does not start with."""
    ids = torch.stack([s["input_ids"] for s in _samples(2, 25, seed=9)])
    ids[ids == 3] = 4
    ids[0, token_3_at] = 3
    return {"input_ids": ids}


def _verified(module: L.LightningModule, token_3_at: int = 13) -> dict:
    torch._dynamo.reset()
    result = verify(
        module, agreement_batch(token_3_at), sp_size=2, accelerator="cpu", show=False, compiler="aot_eager"
    )
    try:  # verify all-gathers the ranks' results: a rank left inside a collective would not get here
        dist.barrier()
        in_step = True
    except Exception:
        in_step = False
    return {
        "verdict": result.verdict,
        "errors": [r.error for r in result.ranks],
        "loss_rel_err": result.loss_rel_err,
        "grad_rel_err": result.grad_rel_err,
        "explain": result.explain,
        "in_step": in_step,
    }


def check_agreement() -> dict:
    _set_pg_timeout(AGREEMENT_TIMEOUT)
    recorder = _SignatureRecorder()
    with mock.patch.object(backend_module, "agree", recorder):
        results = {"uneven_shards": _verified(GPTModule())}
    results["uneven_shards"]["signatures"] = recorder.signatures
    results["branch_on_rank"] = _verified(BranchingGPT("rank"))
    results["branch_on_any_token"] = _verified(BranchingGPT("any_token"), token_3_at=13)
    results["branch_on_first_token"] = _verified(BranchingGPT("first_token"), token_3_at=0)
    return results
