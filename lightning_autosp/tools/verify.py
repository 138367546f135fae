"""``verify``: is sequence parallelism exact for *this* module and *this* batch?

Note [Verifying a user's model]
    One training step of the user's LightningModule runs twice on the same weights and batch: under
    ``AutoSPStrategy`` with the options the real run will use, and on one device, eagerly (the
    reference). Every rank compares the loss its step returned and every parameter's gradient after
    backward (raw: before any optimizer step) with the reference, which each rank computes for itself
    from the weights its SP run started from (after DDP's broadcast from rank 0, or FSDP's sharding and
    initialisation: a module built differently in each process, unseeded, is still compared with
    itself); the ranks then all-gather their numbers, so every rank returns the same result and the
    worst rank decides.

    The SP run is a Lightning Trainer on ``devices`` processes: from a script, Lightning launches them by
    running the script again (as for any ``Trainer(devices=N)``); under torchrun or SLURM it uses the
    processes that are there. Every dp group gets the same batch, so the gradients DDP averages over dp
    groups are the single-device ones. A step the SP pass refuses is a verdict, not a crash: the
    refusal, the same on every rank (Note [Ranks agree on their graphs]), is the result.

    Gradients are compared as in the parity tests: per parameter, max |a - b| over max |b|, where a
    parameter whose gradients are below 1e-3 of the model's largest is compared against that floor
    (rounding in a near-zero gradient is not an error in it).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_autosp.data import find_sequence_length
from lightning_autosp.meta_init import has_meta_tensors
from lightning_autosp.strategy import AutoSPStrategy
from lightning_autosp.tools.verify_report import RankResult, VerifyResult

GRAD_SCALE_FLOOR = 1e-3


def verify(
    module: pl.LightningModule,
    batch: Any,
    *,
    sp_size: int = 2,
    devices: int | None = None,
    accelerator: str = "auto",
    precision: str = "32-true",
    seq_len: int | None = None,
    seed: int = 0,
    show: bool = True,
    **strategy_options: Any,
) -> VerifyResult:
    """Run one training step of ``module`` on ``batch`` on one device and under ``AutoSPStrategy``, and
    compare the loss and every parameter's gradient (Note [Verifying a user's model]).

    Args:
        module: the LightningModule, as the real run builds it (its weights are copied, not changed).
        batch: one batch as the dataloader yields it (the whole sequence; every rank gets all of it).
        sp_size: ranks per sp group. devices: processes (default ``sp_size``; a multiple of it).
        accelerator: "cpu" (gloo), "gpu"/"cuda" (NCCL) or "auto".
        precision: the Trainer's precision; fp32 is held to loss 1e-5 and gradients 1e-4 (relative),
            bf16/fp16 to 1e-2 and 3e-2.
        seq_len: cut every sequence tensor of the batch to this many tokens first.
        show: print the result's table on global rank 0.
        **strategy_options: ``AutoSPStrategy`` options (compiler, sac, chunked_loss, data_parallel,
            ulysses_degree, ...), as the real run will use them.

    Returns the same :class:`VerifyResult` on every rank; ``result.passed`` says whether the step is exact.
    """
    devices = sp_size if devices is None else devices
    if devices % sp_size:
        raise ValueError(f"devices={devices} must be a multiple of sp_size={sp_size}.")
    strategy = AutoSPStrategy(sp_size=sp_size, **strategy_options)  # checks the options here, once
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization; verify compares the gradients of automatic "
            "optimization's backward. Verify a copy with automatic_optimization=True and a training_step "
            "that returns the loss."
        )
    if seq_len is not None:
        batch = cut_sequence(batch, seq_len, strategy.seq_dim, strategy.sequence_keys)
    length = find_sequence_length(batch, strategy.seq_dim, strategy.sequence_keys)
    accelerator = _resolve_accelerator(accelerator)
    with _quiet_lightning():
        sp_run = _sp_step(module, batch, strategy, devices, accelerator, precision, seed)
    reference = reference_step(module, batch, precision, _local_device(accelerator), seed, sp_run.weights)
    ranks = _gather(_compare(sp_run, reference))
    result = VerifyResult(
        ranks=ranks,
        sp_size=sp_size,
        devices=devices,
        accelerator=accelerator,
        precision=precision,
        seq_len=length,
        options=non_default_options(strategy_options),
        explain=strategy.explain(),
        module=type(module).__qualname__,
    )
    if show and _global_rank() == 0:
        print_result(result)
    return result


def print_result(result: VerifyResult) -> None:
    """The table, with rich when it is installed (``lightning_autosp[plot]``), else as markdown."""
    try:
        from rich.console import Console
    except ModuleNotFoundError:
        print(result, flush=True)
        return
    Console(width=max(Console().width, 110)).print(result)


def cut_sequence(
    batch: Any, seq_len: int, seq_dim: int = 1, sequence_keys: Sequence[str] | None = None
) -> Any:
    """The batch with every sequence tensor (``seq_dim`` as long as the sequence) cut to ``seq_len``."""
    length = find_sequence_length(batch, seq_dim, sequence_keys)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be a positive number of tokens.")
    if seq_len >= length:
        return batch
    return apply_to_collection(
        batch,
        torch.Tensor,
        lambda t: t.narrow(seq_dim, 0, seq_len) if t.dim() > seq_dim and t.shape[seq_dim] == length else t,
    )


@dataclass
class Reference:
    loss: float
    grads: dict[str, torch.Tensor]


def reference_step(
    module: pl.LightningModule,
    batch: Any,
    precision: str,
    device: torch.device,
    seed: int,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> Reference:
    """One eager training step of a copy of ``module`` on one device, starting from ``weights`` (the
    parameters and buffers by name; default: the module's own): its loss and gradients."""
    model = copy.deepcopy(module)
    torch.manual_seed(seed)
    model.configure_model()  # the SP run's Trainer calls it too (Lightning asks it to be idempotent)
    if has_meta_tensors(model):
        raise ValueError(
            f"{type(module).__name__} builds its weights on the meta device, so it has no single-device "
            "reference. Verify a configuration that fits one device (fewer layers, a smaller hidden size): "
            "what the SP pass rewrites does not depend on the model's size."
        )
    plugin = _precision_plugin(precision, device)
    model = plugin.convert_module(model).to(device)
    model.train()
    if weights:
        with torch.no_grad():
            for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
                if name in weights:
                    tensor.copy_(weights[name])
    batch = model.on_before_batch_transfer(batch, 0)
    batch = model.transfer_batch_to_device(batch, device, 0)
    batch = plugin.convert_input(model.on_after_batch_transfer(batch, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer here: logging is a no-op
        with plugin.forward_context():
            loss = _loss_of(model.training_step(batch, 0), type(module).__name__)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return Reference(loss.item(), grads)


def parameter_errors(
    grads: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Per parameter: max |a - b| / max(max |b|, 1e-3 * the largest |b| of any parameter); a parameter
    without a gradient counts as zeros (``benchmarks.common.grad_rel_err`` is the max of these)."""
    largest = max((ref.abs().max().item() for ref in reference.values()), default=0.0)
    floor = GRAD_SCALE_FLOOR * largest
    errors = {}
    for name, ref in reference.items():
        got = grads.get(name)
        got = torch.zeros_like(ref) if got is None else got.to(ref.device, ref.dtype)
        scale = max(ref.abs().max().item(), floor, 1e-12)
        errors[name] = (got - ref).abs().max().item() / scale
    return errors


class _Capture(pl.Callback):
    """The SP step's starting weights (whole, on the CPU), loss and raw gradients (after DDP's or FSDP's
    reduction)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.loss: float | None = None
        self.error: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = itertools.chain(pl_module.named_parameters(), pl_module.named_buffers())
        self.weights = {name: _full(t).detach().to("cpu", copy=True) for name, t in named}

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: not yet unscaled here
        scale = scaler.get_scale() if scaler is not None else 1.0
        self.grads = {
            name: _full(p.grad).detach().clone() / scale
            for name, p in pl_module.named_parameters()
            if p.grad is not None
        }

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any
    ) -> None:
        self.loss = float(outputs["loss"])


def _sp_step(
    module: pl.LightningModule,
    batch: Any,
    strategy: AutoSPStrategy,
    devices: int,
    accelerator: str,
    precision: str,
    seed: int,
) -> _Capture:
    capture = _Capture()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # every dp group steps on the whole batch, as the reference does
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[capture],
    )
    torch.manual_seed(seed)
    try:
        trainer.fit(copy.deepcopy(module), DataLoader([batch], batch_size=None))
    except Exception as failure:  # a refusal is the verdict, on every rank alike
        capture.error = _error_text(failure)
    return capture


def _compare(sp_run: _Capture, reference: Reference) -> RankResult:
    result = RankResult(
        rank=_global_rank(), reference_loss=reference.loss, loss=sp_run.loss, error=sp_run.error
    )
    if sp_run.error is None:
        result.grad_errors = parameter_errors(sp_run.grads, reference.grads)
        result.missing_grads = sorted(set(reference.grads) - set(sp_run.grads))
    return result


def _gather(local: RankResult) -> list[RankResult]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    ranks: list[RankResult | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    return [r for r in ranks if r is not None]


def _loss_of(output: Any, name: str) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{name}.training_step returned {type(output).__name__}; verify needs the loss, as a tensor or "
            "under the 'loss' key of a dict."
        )
    return loss


def _error_text(failure: BaseException) -> str:
    text = f"{type(failure).__name__}: {failure}"
    # Dynamo appends advice on its own logging to every backend error; it is not about the model.
    return text.split("\n\nSet TORCHDYNAMO_VERBOSE=1")[0].strip()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP shard (a collective: every rank calls it in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _precision_plugin(precision: str, device: torch.device) -> Precision:
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(precision, device=device.type)
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)
    raise ValueError(
        f"precision={precision!r} is not one verify knows; use '32-true', '64-true', 'bf16-mixed', "
        "'16-mixed', 'bf16-true' or '16-true'."
    )


def _resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        return "gpu"
    if accelerator not in ("cpu", "gpu"):
        raise ValueError(
            f"accelerator={accelerator!r} is not supported by verify; use 'cpu', 'gpu' or 'auto'."
        )
    return accelerator


def _local_device(accelerator: str) -> torch.device:
    if accelerator == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def non_default_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that differ from AutoSPStrategy's (and DDP's) defaults, for the table's title."""
    defaults: dict[str, Any] = {}
    for function in (DistributedDataParallel.__init__, DDPStrategy.__init__, AutoSPStrategy.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults[name] = parameter.default
    return {
        name: value
        for name, value in options.items()
        if (name not in defaults or value != defaults[name]) and (value is None or _is_plain(value))
    }


def _is_plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str, list, tuple))


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's start-up lines (GPU available, ...) would bury the table."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
