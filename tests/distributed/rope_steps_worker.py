"""Llama with transformers' dynamic-NTK rope over steps of varying length, under AutoSPStrategy on 2
ranks (sp=2), against the same steps on one device (Note [Eager code between graphs]).

    torchrun --nproc_per_node=2 tests/distributed/rope_steps_worker.py --out results.json

The rope recomputes its frequencies in Python after a branch on ``max(position_ids)``: Dynamo breaks each
step into several graphs and gives up on transformers' wrapper frames, which run eagerly. The lengths go
past ``max_position_embeddings`` (16), further past it, back below it (transformers' reset branch, a
``register_buffer`` Dynamo cannot trace) and past it again: the rope's state after each step is the
single-device one, so every step's loss and gradients are compared. Rank 0 writes both runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lightning_autosp import AutoSPStrategy  # noqa: E402
from tests.distributed.modules import VOCAB  # noqa: E402
from tests.distributed.user_modules import HFModule  # noqa: E402
from tests.launch import end_worker  # noqa: E402

LENGTHS = (27, 31, 12, 20, 27)  # grow, grow, reset below 16, grow, unchanged
ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


class Batches(IterableDataset):
    """The same batches on every rank, in order (no sampler splits them)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.batches = [{"input_ids": torch.randint(1, VOCAB, (2, n), generator=generator)} for n in LENGTHS]

    def __iter__(self):
        return iter(self.batches)


class DynamicRopeLlama(HFModule):
    def __init__(self) -> None:
        super().__init__("llama", max_position_embeddings=16, rope_parameters=ROPE)
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, optimizer) -> None:  # lr 0: the weights stay, the rope's state moves
        grads = [p.grad.flatten() for p in self.parameters() if p.grad is not None]
        self.steps.append({"grads": torch.cat(grads).tolist()})

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps[-1]["loss"] = float(outputs["loss"])


def single_device(module: DynamicRopeLlama) -> list[dict]:
    steps = []
    for batch in Batches():
        module.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        grads = [p.grad.flatten() for p in module.parameters() if p.grad is not None]
        steps.append({"loss": float(loss), "grads": torch.cat(grads).tolist()})
    return steps


def sequence_parallel(module: DynamicRopeLlama) -> list[dict]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=AutoSPStrategy(sp_size=2, compiler="aot_eager", timeout=timedelta(seconds=300)),
        max_steps=len(LENGTHS),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(Batches(), batch_size=None))
    return module.steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    module = DynamicRopeLlama()
    reference = single_device(copy.deepcopy(module))
    try:
        sharded = sequence_parallel(module)
    except Exception as error:  # recorded: the test shows it
        sharded = {"error": f"{type(error).__name__}: {error}"}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"reference": reference, "sp": sharded}))
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
