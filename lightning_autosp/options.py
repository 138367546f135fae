"""Checks of ``AutoSPStrategy``'s constructor arguments that no other module owns.

The strategy runs them when it is made, in the launching process: a wrong value fails there once,
instead of on every rank after the processes have started (or at the first collective).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_autosp.data import RING_LAYOUTS

# Set by the strategy itself (DDPStrategy passes module and device_ids to DistributedDataParallel).
_SET_BY_THE_STRATEGY = {"self", "module", "device_ids"}
_DDP_STRATEGY_HOOKS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_PLUGIN_TYPES: dict[str, tuple[type, str]] = {
    "accelerator": (Accelerator, "Trainer(accelerator='gpu')"),
    "cluster_environment": (ClusterEnvironment, "Trainer(plugins=[SLURMEnvironment()])"),
    "checkpoint_io": (CheckpointIO, "Trainer(plugins=[TorchCheckpointIO()])"),
    "precision_plugin": (Precision, "Trainer(precision='bf16-mixed')"),
}


def process_group_timeout(timeout: object) -> timedelta | None:
    """``timeout`` as torch.distributed wants it: seconds (an int or a float) become a ``timedelta``."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout={timeout!r} is not a duration; pass seconds (timeout=60) or a datetime.timedelta "
            "(timeout=timedelta(minutes=5))."
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"timeout={timeout!r} must be a positive, finite time; e.g. timeout=600 (seconds), or None for "
            "torch's default."
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def check_hang_timeout(hang_timeout: object) -> float | None:
    """``hang_timeout`` in seconds, or None (the watch off)."""
    if hang_timeout is None:
        return None
    if isinstance(hang_timeout, timedelta):
        hang_timeout = hang_timeout.total_seconds()
    if (
        not isinstance(hang_timeout, (int, float))
        or isinstance(hang_timeout, bool)
        or not (math.isfinite(hang_timeout) and hang_timeout > 0)
    ):
        raise ValueError(
            f"hang_timeout={hang_timeout!r} must be a positive number of seconds (hang_timeout=300), or None "
            "to turn the hang watch off."
        )
    return float(hang_timeout)


def check_strategy_arguments(
    *,
    seq_dim: object,
    sequence_keys: object,
    save_distributed_checkpoint: object,
    check_samples: object,
    gather_predictions: object,
    process_group_backend: object,
    start_method: object,
    ring_layout: object,
    trace_length: object,
    parallel_devices: object,
    plugins: Mapping[str, object],
    ddp_kwargs: Mapping[str, Any],
) -> None:
    """Raise on an argument of the wrong type or an unknown option, naming what to pass instead."""
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool) or seq_dim < 0:
        raise ValueError(
            f"seq_dim={seq_dim!r} must be the index of the sequence dimension, a non-negative int "
            "(seq_dim=1 for (batch, seq) token tensors)."
        )
    if sequence_keys is not None and (
        isinstance(sequence_keys, str) or not all(isinstance(key, str) for key in sequence_keys)
    ):
        suggestion = [sequence_keys] if isinstance(sequence_keys, str) else ["input_ids"]
        raise TypeError(
            f"sequence_keys={sequence_keys!r} must be a list of batch keys: sequence_keys={suggestion!r}."
        )
    if ring_layout not in RING_LAYOUTS:
        raise ValueError(f"ring_layout={ring_layout!r} is not supported; use one of {RING_LAYOUTS}.")
    if trace_length not in ("auto", "shard", "whole"):
        raise ValueError(
            f"trace_length={trace_length!r} is not supported; use 'shard' (trace the steps at this rank's "
            "length), 'whole' (at the whole sequence's, for Python that computes with the length) or "
            "'auto' (the shard's until a step branches on the length)."
        )
    if not isinstance(save_distributed_checkpoint, bool):
        raise TypeError(f"save_distributed_checkpoint={save_distributed_checkpoint!r} must be True or False.")
    if not isinstance(check_samples, bool):
        raise TypeError(
            f"check_samples={check_samples!r} must be True (the ranks of an sp group check that they hold "
            "the same sample before each step) or False."
        )
    if not isinstance(gather_predictions, bool):
        raise TypeError(
            f"gather_predictions={gather_predictions!r} must be True (predict_step's sequence outputs "
            "gathered whole on every rank) or False (each rank keeps its shard)."
        )
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise TypeError(
            f"process_group_backend={process_group_backend!r} must be a backend name such as 'nccl' or "
            "'gloo', or None for the device's default."
        )
    available = ("popen", *torch.multiprocessing.get_all_start_methods())
    if start_method not in _START_METHODS or start_method not in available:
        choices = [method for method in _START_METHODS if method in available]
        raise ValueError(f"start_method={start_method!r} is not available here; use one of {choices}.")
    if parallel_devices is not None and not all(isinstance(d, torch.device) for d in parallel_devices):
        raise TypeError(
            f"parallel_devices={parallel_devices!r} must be a list of torch.device; to choose devices, pass "
            "Trainer(devices=...) instead."
        )
    for name, value in plugins.items():
        expected, instead = _PLUGIN_TYPES[name]
        if value is not None and not isinstance(value, expected):
            raise TypeError(
                f"{name}={value!r} must be an instance of {expected.__name__}, or None; to choose one by "
                f"name, pass it to the Trainer instead, e.g. {instead}."
            )
    unknown = sorted(set(ddp_kwargs) - _accepted_ddp_options())
    if unknown:
        raise TypeError(
            f"AutoSPStrategy got unknown options {unknown}. Other keyword arguments go to "
            f"DistributedDataParallel or DDPStrategy, which accept {sorted(_accepted_ddp_options())}."
        )


def _accepted_ddp_options() -> set[str]:
    ddp = set(inspect.signature(DistributedDataParallel.__init__).parameters) - _SET_BY_THE_STRATEGY
    hooks = set(_DDP_STRATEGY_HOOKS) & set(inspect.signature(DDPStrategy.__init__).parameters)
    return ddp | hooks


def given_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy's options as given (``locals()`` at the start of ``__init__``), as keyword arguments:
    every argument and DDP keyword but Lightning's plugins and devices, which the Trainer fills in."""
    left_out = {"self", "__class__", "ddp_kwargs", "parallel_devices", *_PLUGIN_TYPES}
    options = {name: value for name, value in arguments.items() if name not in left_out}
    return {**options, **arguments.get("ddp_kwargs", {})}
