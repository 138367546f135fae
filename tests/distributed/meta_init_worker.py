"""Peak host memory of setting up a ~300 MB model under data_parallel="fsdp", built on the meta device or
whole, on every rank (run under torchrun; results go to ``<out>/rank<r>.json``).

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc_per_node=4 tests/distributed/meta_init_worker.py --out DIR

Each phase is a ``Trainer.fit`` with ``max_steps=0`` (the strategy's setup: planning, sharding, the
optimizer; no step), measured as the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` at the start) less its resident set at the start. Phases, in this order:

- ``meta_per_use``: the model is built in ``configure_model`` under ``trainer.init_module(empty_init=True)``,
  and ``sp_size="auto"`` plans for it (``strategy.sp_plan``);
- ``meta_per_step``: built under ``trainer.init_module(empty_init=True)`` before ``fit``,
  ``fsdp_gather="per_step"``;
- ``whole_per_use``: built whole on every rank, as before meta-device support.

Large allocations are mapped and unmapped one by one (``MALLOC_MMAP_THRESHOLD_``), so memory one phase
frees is not reused unseen by the next.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.models import TinyGPT  # noqa: E402
from lightning_autosp import AutoSPStrategy  # noqa: E402
from tests.launch import end_worker  # noqa: E402

# 24 layers of width 512: 75.6M parameters, 302 MB in fp32; the largest module (an MLP's first
# projection) is 4 MB, so the whole model dominates what setup holds besides its shard.
SHAPE = {"vocab_size": 256, "block_size": 64, "n_layer": 24, "n_head": 4, "n_embd": 512}
SEQ_LEN = 32


class BigGPT(L.LightningModule):
    """Builds its model in ``configure_model`` (on the meta device) or in ``__init__``."""

    def __init__(self, build_in_configure_model: bool) -> None:
        super().__init__()
        self.save_hyperparameters(SHAPE)  # the planner reads the shapes from here
        self.model = None if build_in_configure_model else TinyGPT(**SHAPE)

    def configure_model(self) -> None:
        if self.model is None:
            with self.trainer.init_module(empty_init=True):
                self.model = TinyGPT(**SHAPE)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024


def _release_freed_memory() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def setup_only(module: L.LightningModule, strategy: AutoSPStrategy, init_module: bool = False) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if init_module:
        with trainer.init_module(empty_init=True):
            module = BigGPT(build_in_configure_model=False)
    ids = torch.zeros(SEQ_LEN, dtype=torch.long)
    trainer.fit(module, DataLoader([{"input_ids": ids}] * dist.get_world_size()))
    return trainer


def run_phase(name: str) -> dict:
    _release_freed_memory()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    start = _status_mib("VmRSS")
    options = {"data_parallel": "fsdp", "compiler": "aot_eager"}
    if name == "meta_per_use":
        strategy = AutoSPStrategy(sp_size="auto", max_seq_len=SEQ_LEN, memory_per_device=2**40, **options)
        trainer = setup_only(BigGPT(build_in_configure_model=True), strategy)
    elif name == "meta_per_step":
        strategy = AutoSPStrategy(sp_size=2, fsdp_gather="per_step", **options)
        trainer = setup_only(None, strategy, init_module=True)
    else:
        strategy = AutoSPStrategy(sp_size=2, **options)
        trainer = setup_only(BigGPT(build_in_configure_model=False), strategy)
    peak = _status_mib("VmHWM")
    params = list(trainer.lightning_module.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params) * 4
    result = {
        "setup_peak_mib": peak - start,
        "full_mib": sum(p.numel() for p in params) * 4 / 2**20,
        "local_mib": local / 2**20,
        "sharded": all(isinstance(p, DTensor) for p in params),
        "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in params),
        "planned_params_bytes": strategy.sp_plan.memory.params if strategy.sp_plan else None,
        "full_bytes_per_rank": sum(p.numel() for p in params) * 4 // dist.get_world_size(),
    }
    del trainer, strategy, params
    torch._dynamo.reset()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    results = {}
    for name in ("meta_per_use", "meta_per_step", "whole_per_use"):
        try:
            results[name] = run_phase(name)
        except Exception as error:  # recorded per phase so one failure does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    end_worker()


if __name__ == "__main__":
    main()
