"""What the same-sample check costs per step (Note [Ranks hold the same sample]).

    python -m benchmarks.sample_check [--steps 30] [--seq-len 512] [--out FILE.json]

Trains ``examples/configs/cpu_demo.yaml``'s model and data (HF Llama, 512 tokens, batch 4, sp=2 on 2 CPU
processes, aot_eager) and times, on every rank, each call of the check (the digest of the batch, the
all-gather over the sp group and the comparison) and each training step, leaving out the first steps
(compiles). Lightning launches the second process by running this module again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
import torch.distributed as dist

import lightning_autosp.strategy as strategy_module
from examples.data import StdlibDataModule
from examples.models import LlamaModule
from lightning_autosp import AutoSPStrategy

WARMUP_STEPS = 3


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sample_check.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0)
    check_seconds: list[float] = []
    timed = strategy_module.check_same_sample

    def timing_check(*check_args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        timed(*check_args, **kwargs)
        check_seconds.append(time.perf_counter() - start)

    steps = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=AutoSPStrategy(sp_size=2, compiler="aot_eager"),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[steps],
    )
    data = StdlibDataModule(seq_len=args.seq_len, batch_size=4, max_bytes=1 << 20)
    with mock.patch.object(strategy_module, "check_same_sample", timing_check):
        trainer.fit(LlamaModule(max_position_embeddings=args.seq_len), datamodule=data)
    mine = {
        "check_ms": 1e3 * statistics.median(check_seconds[WARMUP_STEPS:]),
        "step_ms": 1e3 * statistics.median(steps.seconds[WARMUP_STEPS:]),
    }
    gathered: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if trainer.global_rank == 0:
        check_ms = max(r["check_ms"] for r in gathered)
        step_ms = statistics.median(r["step_ms"] for r in gathered)
        result = {
            "ranks": gathered,
            "check_ms": check_ms,
            "step_ms": step_ms,
            "share": check_ms / step_ms,
            "steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size": 4,
        }
        args.out.write_text(json.dumps(result, indent=1))
        summary = (
            f"same-sample check: {check_ms:.2f} ms per step (median, slowest rank) of a {step_ms:.0f} ms "
            f"step ({100 * check_ms / step_ms:.2f}%); HF Llama (hidden 128, 2 layers), {args.seq_len} tokens "
            f"x batch 4, sp=2 on 2 CPU processes (gloo), aot_eager, steps {WARMUP_STEPS + 1}-{args.steps}."
        )
        args.out.with_suffix(".md").write_text(summary + "\n")
        print(summary)


if __name__ == "__main__":
    main()
