"""Checkpoints of ``AutoSPStrategy``: Lightning's own under "ddp", sharded-state ones under "fsdp".

With ``data_parallel="fsdp"`` the parameters and optimizer state are DTensor shards over all ranks
(``fsdp.py``). A checkpoint is then either one full file assembled on rank 0 (Lightning's format,
loadable on one device) or, with ``save_distributed_checkpoint=True``, one shard per rank written by
``torch.distributed.checkpoint``; either is loaded after setup, once the sharded module exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer
from typing_extensions import override

from lightning_autosp import fsdp


class ShardedCheckpoints:
    """Lightning's checkpoint hooks of a strategy, routed to ``fsdp.py`` when ``data_parallel == "fsdp"``.

    A mixin in front of ``DDPStrategy`` (whose hooks serve "ddp"); the strategy sets ``data_parallel``
    and ``_save_distributed_checkpoint``.
    """

    data_parallel: fsdp.DataParallel
    _save_distributed_checkpoint: bool

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.data_parallel == "fsdp"

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self.data_parallel != "fsdp"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.data_parallel != "fsdp":
            return super().lightning_module_state_dict()
        return fsdp.model_state_dict(self.model, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.data_parallel != "fsdp":
            return super().optimizer_state(optimizer)
        full = not self._save_distributed_checkpoint
        return fsdp.optimizer_state_dict(self.model, optimizer, full=full, rank=self.global_rank)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.data_parallel != "fsdp":  # else load_checkpoint has loaded it
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.data_parallel != "fsdp":  # else load_checkpoint has loaded it
            super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if self.data_parallel != "fsdp":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))  # one path for all ranks
        if not self._save_distributed_checkpoint:
            if self.is_global_zero:
                fsdp.remove_distributed_checkpoint(path)
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(
                "save_checkpoint(storage_options=...) is not supported with save_distributed_checkpoint=True:"
                " torch.distributed.checkpoint writes the shards, not the CheckpointIO plugin."
            )
        fsdp.save_distributed_checkpoint(checkpoint, path, rank=self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if self.data_parallel != "fsdp":
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return fsdp.load_checkpoint(
            Path(self.broadcast(checkpoint_path)),
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )
