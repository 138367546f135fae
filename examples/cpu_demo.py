"""Train a small Llama on the Python stdlib with sequence parallelism over CPU processes.

    python examples/cpu_demo.py                    # AutoSP, 2 processes, each holding half of every sequence
    python examples/cpu_demo.py --strategy ddp     # plain data parallelism, for comparison

Rank 0 prints the first and last logged training loss at the end.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, Strategy

# Run as a script, so make ``examples`` importable from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.data import StdlibDataModule  # noqa: E402
from examples.models import LlamaModule  # noqa: E402
from lightning_autosp import AutoSPStrategy, MemoryMonitor  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps to train for")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens (bytes) per sequence")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes to launch")
    parser.add_argument("--strategy", choices=["autosp", "ddp"], default="autosp")
    parser.add_argument("--sp-size", type=int, default=2, help="sequence-parallel group size (autosp only)")
    parser.add_argument(
        "--compiler",
        choices=["aot_eager", "inductor"],
        default="aot_eager",
        help="compile backend (autosp only)",
    )
    parser.add_argument("--log-dir", default="logs", help="where CSVLogger writes metrics.csv")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> Strategy:
    if args.strategy == "autosp":
        return AutoSPStrategy(sp_size=args.sp_size, compiler=args.compiler)
    # Gloo: NCCL does not exist on CPU.
    return DDPStrategy(process_group_backend="gloo")


def logged_losses(metrics_csv: Path, key: str = "train_loss") -> list[tuple[int, float]]:
    """Return ``(step, value)`` for every row of a CSVLogger file that logged ``key``."""
    with metrics_csv.open(newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)

    datamodule = StdlibDataModule(seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed)
    model = LlamaModule(max_position_embeddings=args.seq_len, lr=args.lr)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args),
        max_steps=args.max_steps,
        callbacks=[MemoryMonitor(every_n_steps=10)],
        logger=CSVLogger(args.log_dir),
        log_every_n_steps=5,
        # Validate once, on a few batches, at the end; count steps across epochs so a short corpus
        # (large --seq-len) cannot make the interval exceed one epoch.
        val_check_interval=args.max_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=8,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=datamodule)

    if trainer.is_global_zero:
        metrics_csv = Path(trainer.logger.log_dir) / "metrics.csv"
        losses = logged_losses(metrics_csv)
        if losses:
            (first_step, first), (last_step, last) = losses[0], losses[-1]
            print(f"train_loss: {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
        val = logged_losses(metrics_csv, "val_loss")
        if val:
            print(f"val_loss:   {val[-1][1]:.3f} (step {val[-1][0]})")
        print(f"metrics: {metrics_csv}")


if __name__ == "__main__":
    main()
