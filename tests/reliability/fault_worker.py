"""A training job in which some ranks fail at step 2, for ``test_faults.py``.

    torchrun --nproc_per_node=2 tests/reliability/fault_worker.py --fault raise --ranks 1 --timeout 20

Every rank trains a tiny GPT under ``AutoSPStrategy(timeout=...)`` (Lightning creates the process group
with that timeout). At ``batch_idx == 2``, after the first compiled steps ran, the ranks in ``--ranks``
fail inside ``training_step``, after the model's forward (so its peers are already inside the step's
collectives):

- ``raise``: raise ``RuntimeError(MESSAGE)``; the process exits with the error.
- ``wedge``: stop forever without exiting (a rank stuck in I/O or a deadlock); its peers must give up
  after ``timeout`` instead of waiting for the default 30 minutes.
- ``diverge``: make one collective more than their peers (an all-reduce of the world group), so every
  rank ends up waiting in a different collective; the strategy's hang watch (``--hang-timeout``) must
  end every rank with its report.
- ``slow_compile``: take ``SLOW_COMPILE_S`` longer than their peers to compile the first step (a sleep
  at the start of the first Dynamo compile on those ranks), while the peers wait for them in collectives;
  the hang watch must not take that for a hang, and the job trains to the end.

A rank that leaves ``trainer.fit`` with an exception prints ``AUTOSP_FAULT rank=<r> after=<s>s
<type>: <message>`` to stderr (``after``: seconds since it entered the failing step) and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autosp import AutoSPStrategy  # noqa: E402
from tests.distributed.modules import VOCAB, GPTModule  # noqa: E402

MESSAGE = "injected failure on rank {rank} at step 2"
FAULT_STEP = 2
SLOW_COMPILE_S = 45.0
_fault_started: list[float] = []


@torch._dynamo.disable
def inject(rank: int, batch_idx: int, fault: str, ranks: list[int]) -> None:
    if batch_idx != FAULT_STEP:
        return
    _fault_started.append(time.monotonic())
    if rank not in ranks:
        return
    if fault == "raise":
        raise RuntimeError(MESSAGE.format(rank=rank))
    if fault == "diverge":
        torch.distributed.all_reduce(torch.ones(1))  # only these ranks: the others are in backward's
        return
    deadline = time.monotonic() + 300  # bounded, so that a job the harness failed to kill ends anyway
    while time.monotonic() < deadline:  # wedged: alive, never reaching the next collective
        time.sleep(1)
    os._exit(3)


class FaultyGPT(GPTModule):
    def __init__(self, fault: str, ranks: list[int]) -> None:
        super().__init__()
        self.fault, self.fault_ranks = fault, ranks

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(ids)  # all-to-alls: every healthy rank is inside the step's collectives
        if self.fault != "slow_compile":
            inject(self.global_rank, batch_idx, self.fault, self.fault_ranks)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=("raise", "wedge", "diverge", "slow_compile"), required=True)
    parser.add_argument("--ranks", type=int, nargs="+", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=None, help="default: the strategy's")
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if args.fault == "slow_compile" and rank in args.ranks:
        slept: list[bool] = []
        torch._dynamo.callback.callback_handler.register_start_callback(
            lambda _: slept or slept.append(True) or time.sleep(SLOW_COMPILE_S)
        )
    hang = {} if args.hang_timeout is None else {"hang_timeout": args.hang_timeout}

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": row} for row in ids]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=AutoSPStrategy(
            sp_size=args.sp_size, compiler="aot_eager", timeout=timedelta(seconds=args.timeout), **hang
        ),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(FaultyGPT(args.fault, args.ranks), DataLoader(samples, batch_size=2))
    except BaseException as error:
        after = time.monotonic() - _fault_started[0] if _fault_started else -1.0
        print(f"AUTOSP_FAULT rank={rank} after={after:.1f}s {type(error).__name__}: {error}", file=sys.stderr)
        sys.stderr.flush()
        raise
    print(f"AUTOSP_FINISHED rank={rank}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
