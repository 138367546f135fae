"""``autosp``: LightningCLI with the AutoSP strategy registered, and a ``verify`` subcommand.

    autosp fit --config examples/configs/cpu_demo.yaml
    autosp verify --config examples/configs/cpu_demo.yaml [--seq_len 512] [--devices 2] [--accelerator cpu]

``strategy: autosp`` and ``strategy: {class_path: lightning_autosp.AutoSPStrategy, init_args: ...}``
both work, since importing this package registers the strategy. Class paths are imported from the
working directory too, as under ``python -m``: ``class_path: examples.models.LlamaModule`` works from
the repository root.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.cli import LightningCLI

from lightning_autosp.strategy import AutoSPStrategy
from lightning_autosp.tools.verify import VerifyResult, verify

# Chosen by verify itself, or meaningful only for sp_size="auto".
_NOT_PASSED_ON = ("sp_size", "max_seq_len", "memory_per_device")


class AutoSPTrainer(pl.Trainer):
    """Lightning's Trainer with :meth:`verify`, which ``autosp verify`` runs."""

    def verify(
        self,
        model: pl.LightningModule,
        datamodule: pl.LightningDataModule | None = None,
        seq_len: int | None = 512,
        sp_size: int | None = None,
        devices: int | None = None,
        accelerator: str | None = None,
        seed: int = 0,
    ) -> VerifyResult:
        """Check that sequence parallelism is exact for this model: its SP step against one device.

        One training step on one device and one under AutoSPStrategy with this config's options, on the first
        training batch; the loss and every gradient are compared and printed (Note [Verifying a user's
        model] in ``lightning_autosp/tools/verify.py``).

        Args:
            seq_len: cut the first training batch to this many tokens (None: keep the loader's length)
            sp_size: ranks per sp group (default: the strategy's sp_size, else all devices)
            devices: processes for the SP run (default: the config's trainer.devices)
            accelerator: cpu or gpu (default: the config's trainer.accelerator)
            seed: seeds the first batch's loader and the weights of a model built in configure_model
        """
        options = self.strategy.options if isinstance(self.strategy, AutoSPStrategy) else {}
        devices = devices or self.num_devices
        configured_sp = options.get("sp_size")
        sp_size = sp_size or (configured_sp if isinstance(configured_sp, int) else devices)
        return verify(
            model,
            first_batch(model, datamodule, seed),
            sp_size=sp_size,
            devices=devices,
            accelerator=accelerator or _accelerator_name(self.accelerator),
            precision=self.precision,
            seq_len=seq_len,
            seed=seed,
            **{k: v for k, v in options.items() if k not in _NOT_PASSED_ON},
        )


def first_batch(model: pl.LightningModule, datamodule: pl.LightningDataModule | None, seed: int) -> Any:
    """The first training batch of ``datamodule`` (else of the model's ``train_dataloader``), drawn after
    seeding, so that every process draws the same one from a shuffling loader."""
    source = datamodule if datamodule is not None else model
    source.prepare_data()
    source.setup("fit")
    torch.manual_seed(seed)
    return next(iter(source.train_dataloader()))


class AutoSPCLI(LightningCLI):
    """LightningCLI's subcommands, and ``verify`` (exits 1 unless the SP step is exact)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {**LightningCLI.subcommands(), "verify": {"model", "datamodule"}}

    def verify(self, **kwargs: Any) -> None:
        if not self.trainer.verify(**kwargs).passed:
            sys.exit(1)


def _accelerator_name(accelerator: object) -> str:
    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    if isinstance(accelerator, CUDAAccelerator):
        return "gpu"
    raise ValueError(f"autosp verify runs on 'cpu' or 'gpu', not {type(accelerator).__name__}.")


def main(args: list[str] | None = None) -> None:
    # A console script puts its own bin/ directory on sys.path, not the working directory as
    # `python -m` does, so a config's class paths into the user's project would not import. Lightning
    # relaunches this script for every local rank in the same directory, so each rank gets it too.
    working_dir = os.getcwd()
    if working_dir not in sys.path:
        sys.path.insert(0, working_dir)
    AutoSPCLI(trainer_class=AutoSPTrainer, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
