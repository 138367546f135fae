"""Callbacks and data the CLI tests name by class path in their configs (run from the repository root)."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_autosp import AutoSPStrategy


class CompileWithAotEager(Callback):
    """Check that ``strategy: autosp`` gave an ``AutoSPStrategy``, and compile with aot_eager.

    A strategy given by name is built with its defaults, and the default compiler, Inductor, takes about a
    minute of C++ compilation on 2 CPU cores. ``Callback.setup`` runs before ``Strategy.setup`` compiles the
    steps, so switching here keeps the test fast and changes nothing else.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, AutoSPStrategy):
            raise TypeError(f"strategy: autosp gave {type(strategy).__name__}, not AutoSPStrategy")
        strategy.compiler = "aot_eager"


class RandomTokens(L.LightningDataModule):
    """Seeded random token ids, ``vocab_size`` of them (the tests' modules have a vocabulary of 48)."""

    def __init__(
        self, seq_len: int = 32, batch_size: int = 2, vocab_size: int = 48, samples: int = 8
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.vocab_size, self.samples = (
            seq_len,
            batch_size,
            vocab_size,
            samples,
        )

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (self.samples, self.seq_len), generator=generator)
        return DataLoader([{"input_ids": row} for row in ids], batch_size=self.batch_size, shuffle=True)
