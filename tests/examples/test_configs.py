"""The example configs parse with the ``autosp`` CLI's parser and describe the models they claim to.

The GPU configs need 8 GPUs, so here they are only parsed (types checked against every signature by
jsonargparse, nothing instantiated), their model is built on the meta device to count its parameters, and
the strategy and callbacks are constructed, which needs no process group.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_autosp import AutoSPStrategy

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

# Published parameter counts of the models whose shapes the GPU configs copy (embeddings tied in the 1B).
GPU_CONFIGS = {
    "llama_1b_32k.yaml": {"params": 1_235_814_400, "seq_len": 32768, "hidden_size": 2048, "layers": 16},
    "llama_8b_128k.yaml": {"params": 8_030_261_248, "seq_len": 131072, "hidden_size": 4096, "layers": 32},
}


class _ParseOnly(LightningCLI):
    """``autosp fit``'s parsing, without building the trainer, model or data."""

    def instantiate_classes(self) -> None:
        pass


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _build(spec: dict[str, Any]) -> Any:
    return _import(spec["class_path"])(**spec.get("init_args", {}))


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_config_parses_with_the_cli_parser(name: str) -> None:
    # The CLI seeds every RNG from the config's seed_everything and exports PL_GLOBAL_SEED; keep both local.
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["autosp"]), torch.random.fork_rng():
        cli = _ParseOnly(run=False, args=["--config", str(CONFIGS / name)], save_config_callback=None)
    assert cli.config.trainer.strategy.class_path == "lightning_autosp.AutoSPStrategy"
    assert cli.config.model.class_path.startswith("examples.models.")


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_shapes(name: str) -> None:
    expected = GPU_CONFIGS[name]
    config = yaml.safe_load((CONFIGS / name).read_text())
    trainer = config["trainer"]
    data_args = config["data"]["init_args"]
    assert (trainer["accelerator"], trainer["devices"]) == ("gpu", 8)
    assert trainer["precision"] in ("bf16-mixed", "bf16-true")
    assert data_args["seq_len"] == expected["seq_len"] and data_args["batch_size"] == 1

    strategy = _build(trainer["strategy"])
    assert isinstance(strategy, AutoSPStrategy)
    assert (strategy.sp_size, strategy.compiler) == (8, "inductor")
    callbacks = [_build(spec) for spec in trainer["callbacks"]]
    assert {type(c).__name__ for c in callbacks} == {"MemoryMonitor", "SequenceThroughputMonitor"}

    with torch.device("meta"):
        module = _build(config["model"])
    module.configure_model()  # builds the model on the meta device when meta_init is set
    assert sum(p.numel() for p in module.parameters()) == expected["params"]
    hf = module.model.config
    assert (hf.hidden_size, hf.num_hidden_layers) == (expected["hidden_size"], expected["layers"])
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size) == (32, 8, 128256)
    assert hf.rope_parameters["rope_theta"] == 500000.0
    assert hf.rope_parameters["rope_type"] == "llama3"

    # What the SP pass needs: heads split over the sp group, and a per-rank length that no other
    # dimension of the attention inputs shares (else it refuses the graph as ambiguous).
    sp = strategy.sp_size
    assert hf.num_attention_heads % sp == 0
    local_len = data_args["seq_len"] // sp
    assert data_args["seq_len"] % sp == 0
    other_sizes = {
        data_args["batch_size"],
        hf.num_attention_heads,
        hf.num_attention_heads // sp,
        hf.num_key_value_heads,
        hf.head_dim,
        hf.hidden_size,
        hf.intermediate_size,
        hf.vocab_size,
    }
    assert local_len not in other_sizes


def test_a_timeout_in_seconds_parses_and_builds_a_strategy() -> None:
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["autosp"]), torch.random.fork_rng():
        cli = _ParseOnly(
            run=False,
            args=["--config", str(CONFIGS / "cpu_demo.yaml"), "--trainer.strategy.init_args.timeout=60"],
            save_config_callback=None,
        )
    init_args = cli.config.trainer.strategy.init_args
    assert AutoSPStrategy(**init_args)._timeout == timedelta(seconds=60)
