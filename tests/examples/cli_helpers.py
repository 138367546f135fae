"""Callbacks that the CLI tests name by class path in their configs (run from the repository root)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

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
