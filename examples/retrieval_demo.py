"""Learn a lookup that only works if attention crosses the sequence-parallel shard boundary.

    python examples/retrieval_demo.py               # 2 CPU processes, each holding half of every sequence

Every sample of :class:`examples.data.RetrievalTask` is random filler with a key pair ``(marker, value)``
in the first quarter and the query ``marker`` at the end; only the answer, ``value``, is supervised. With
``AutoSPStrategy(sp_size=2)`` rank 0 holds the first half of each sequence (the key) and rank 1 the second
(the query), so the model can only answer through attention that crosses the two shards. A tiny GPT
(:class:`examples.models.GPTModule`) trains on it, and rank 0 measures the answer accuracy on held-out
samples every ``--eval-every`` steps (the trained weights, run without sequence parallelism on whole
sequences) and prints the curve. Chance is ``1 / (vocab_size - 1)``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

# Run as a script, so make ``examples`` importable from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.data import RetrievalTask  # noqa: E402
from examples.models import GPTModule  # noqa: E402
from lightning_autosp import AutoSPStrategy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=400, help="optimizer steps to train for")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab-size", type=int, default=16, help="token ids, including the marker")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per batch")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--eval-samples", type=int, default=512, help="held-out samples per evaluation")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes to launch")
    parser.add_argument("--sp-size", type=int, default=2, help="sequence-parallel group size")
    parser.add_argument("--compiler", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--log-dir", default="logs", help="where CSVLogger writes metrics.csv")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def stack(dataset: RetrievalTask) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples of ``dataset`` as ``(input_ids, labels)`` tensors of shape ``(N, seq_len)``."""
    samples = [dataset[i] for i in range(len(dataset))]
    return torch.stack([s["input_ids"] for s in samples]), torch.stack([s["labels"] for s in samples])


@torch.no_grad()
def answer_accuracy(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 256
) -> float:
    """Fraction of samples whose prediction at the query (position -2) is the answer (``labels[:, -1]``)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(input_ids), batch_size):
        logits = model(input_ids[start : start + batch_size])
        correct += (logits[:, -2].argmax(-1) == labels[start : start + batch_size, -1]).sum().item()
    model.train(was_training)
    return correct / len(input_ids)


class HeldOutAccuracy(Callback):
    """Rank 0 evaluates the answer accuracy on held-out samples every ``every`` steps and at the end."""

    def __init__(self, held_out: RetrievalTask, every: int) -> None:
        self.input_ids, self.labels = stack(held_out)
        self.every = every
        self.chance = 1 / (held_out.vocab_size - 1)
        self.curve: list[tuple[int, float, float, float]] = []  # (step, train loss, accuracy, seconds)
        self._start = time.perf_counter()
        self._last_loss = float("nan")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        if trainer.is_global_zero:
            print(
                f"{'step':>6} {'train loss':>10} {'accuracy':>9} {'seconds':>8}   (chance {self.chance:.3f})"
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_loss = float(outputs["loss"])
        if trainer.global_step % self.every == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.curve or self.curve[-1][0] != trainer.global_step:
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Rank 0 only, with no collective: the other ranks wait for it in the next step's all-to-all.
        if not trainer.is_global_zero:
            return
        accuracy = answer_accuracy(pl_module.model, self.input_ids, self.labels)
        seconds = time.perf_counter() - self._start
        self.curve.append((trainer.global_step, self._last_loss, accuracy, seconds))
        bar = "#" * round(40 * accuracy)
        print(f"{trainer.global_step:>6} {self._last_loss:>10.3f} {accuracy:>9.3f} {seconds:>8.1f}   {bar}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)
    # The key sits in the first quarter, the query at the end: with sp_size=2 they are on different ranks.
    train_set = RetrievalTask(args.max_steps * args.batch_size, args.seq_len, args.vocab_size, seed=args.seed)
    held_out = RetrievalTask(args.eval_samples, args.seq_len, args.vocab_size, seed=args.seed + 1)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model = GPTModule(
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        lr=args.lr,
    )
    accuracy = HeldOutAccuracy(held_out, args.eval_every)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=AutoSPStrategy(sp_size=args.sp_size, compiler=args.compiler),
        max_steps=args.max_steps,
        callbacks=[accuracy],
        logger=CSVLogger(args.log_dir, name="retrieval"),
        log_every_n_steps=args.eval_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    wall = time.perf_counter() - start

    if trainer.is_global_zero and accuracy.curve:
        step, _, final, _ = accuracy.curve[-1]
        shard = -(-args.seq_len // args.sp_size)  # balanced shards: rank 0 holds the larger one
        print(
            f"held-out answer accuracy {final:.3f} after {step} steps, {wall:.0f} s of fit "
            f"(chance {accuracy.chance:.3f}); keys in tokens 0-{args.seq_len // 4 - 1}, query at token "
            f"{args.seq_len - 2}, rank 0 held tokens 0-{shard - 1} of every sequence"
        )


if __name__ == "__main__":
    main()
