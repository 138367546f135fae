"""Fully sharded data parallel under AutoSP: ``data_parallel="fsdp"`` (ZeRO-3).

Parameters, gradients and optimizer state are sharded over all dp x sp ranks (a 1-D mesh over the
world) as ``DTensor``s on dim 0, FSDP2's layout. Two ways to gather them for the step:

- ``fsdp_gather="per_use"`` (default, :func:`shard_parameters`): each parameter is all-gathered inside
  the compiled step, right before its use, and again in backward; its gradient is reduce-scattered
  back to the shard. Only a few parameters are whole at any time, so the step's peak is ZeRO-3's.
- ``fsdp_gather="per_step"``: the LightningModule is one FSDP2 ``fully_shard`` unit, whole for the
  step (Note [FSDP units under a compiled step]).

The SP and SAC passes are the same in both. Gradients come out exactly as with ``data_parallel="ddp"``:
the reduce-scatter averages over the world, as DDP's all-reduce does, and the loss all-reduce's backward
supplies the sp factor (Note [Loss over sequence shards] in ``compiler/lower/losses.py``).

Note [FSDP units under a compiled step]
    FSDP2 (torch 2.13) wraps its hooks in ``torch._dynamo.disable`` (tracing them was dropped
    upstream, pytorch/pytorch#174863): calling an FSDP unit from compiled code is a graph break, and a
    graph break inside a ``for`` loop makes Dynamo skip the whole frame (``graph break in loop``).
    Every transformer runs its blocks in such a loop, so sharding the blocks as units would run the
    model's outer frame (positions, masks, the residual stream) eagerly, without sequence parallelism;
    the strategy then raises. With ``fsdp_gather="per_step"`` the unit is therefore the LightningModule
    itself, and the strategy calls each step through the module's ``__call__`` (Lightning's forward
    redirection): FSDP2 all-gathers before the compiled step and registers its backward hooks on the
    step's outputs, and the step compiles as one graph, loss included (the chunked LM head and loss need
    the head and the loss in one graph). The price: the parameters are all-gathered whole for the step,
    so the in-step peak holds the full parameters and gradients; between steps, and for the optimizer
    state always, each rank holds 1/world. ``fsdp_gather="per_use"`` has no hooks: the gathers are ops
    of the graph (:func:`shard_parameters`). Units the user shards in ``configure_model`` are kept
    (either option), and work when the compiled step calls them outside loops and they run compiled
    (the whole model; tested). A unit whose forward runs eagerly (torch's own ``nn.Linear`` as the LM
    head: FSDP2 calls it through its hooks, and Dynamo does not compile torch's modules as frames of
    their own) computes on sequence data outside every graph, and the next graph refuses its output.

Checkpoints follow Lightning's ``ModelParallelStrategy``: a full state dict assembled on rank 0 (a
plain Lightning checkpoint, interchangeable with ``data_parallel="ddp"`` and loadable on one device),
or with ``save_distributed_checkpoint=True`` a directory with one shard per rank
(``torch.distributed.checkpoint``). Lightning's private checkpoint helpers are imported here only.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save, _is_sharded_checkpoint
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.optim import Optimizer

DataParallel = Literal["ddp", "fsdp"]
FSDPGather = Literal["per_use", "per_step"]
WORLD = "dp_sp"


def check_data_parallel(
    data_parallel: object,
    save_distributed_checkpoint: object,
    ddp_kwargs: Mapping[str, Any],
    fsdp_gather: object = None,
    offload_parameters: object = False,
) -> None:
    """Raise on bad ``data_parallel`` options, before any process starts."""
    if not isinstance(offload_parameters, bool):
        raise TypeError(f"offload_parameters={offload_parameters!r} must be True or False.")
    if offload_parameters and (data_parallel != "fsdp" or fsdp_gather != "per_step"):
        raise ValueError(
            "offload_parameters=True keeps the parameter, gradient and optimizer shards in host memory "
            "with FSDP2's CPUOffloadPolicy, which needs AutoSPStrategy(data_parallel='fsdp', "
            f"fsdp_gather='per_step'); it is data_parallel={data_parallel!r}, fsdp_gather={fsdp_gather!r} "
            "(per use, the shards are gathered inside the compiled step, from the device)."
        )
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel={data_parallel!r} is not supported; use 'ddp' or 'fsdp'.")
    if fsdp_gather not in (None, "per_use", "per_step"):
        raise ValueError(f"fsdp_gather={fsdp_gather!r} is not supported; use 'per_use' or 'per_step'.")
    if fsdp_gather is not None and data_parallel != "fsdp":
        raise ValueError(
            f"fsdp_gather={fsdp_gather!r} chooses how data_parallel='fsdp' gathers parameters; with "
            f"data_parallel={data_parallel!r} every rank holds them whole. Remove it, or set "
            "data_parallel='fsdp'."
        )
    if data_parallel == "fsdp" and ddp_kwargs:
        raise ValueError(
            f"{sorted(ddp_kwargs)} are DistributedDataParallel options, which do nothing with "
            "data_parallel='fsdp'; remove them, or shard your own way in configure_model with fully_shard."
        )
    if save_distributed_checkpoint and data_parallel != "fsdp":
        raise ValueError(
            "save_distributed_checkpoint=True needs sharded state; use data_parallel='fsdp' (with 'ddp' "
            "every rank holds the whole model and checkpoints are single files)."
        )


def build_world_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """A 1-D mesh over all dp x sp ranks (it reuses the default process group)."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=(WORLD,))


def shard_module(
    module: nn.Module, mesh: DeviceMesh, gather: FSDPGather = "per_use", *, offload: bool = False
) -> None:
    """Shard ``module`` over ``mesh``, unless the user sharded it in configure_model.

    ``gather="per_use"`` shards each parameter and gathers it where the compiled step uses it
    (:func:`shard_parameters`); ``"per_step"`` makes the whole module one FSDP2 unit, gathered around
    each step (Note [FSDP units under a compiled step]); ``offload`` keeps its shards (and so the
    gradients' and optimizer state's) in host memory, with FSDP2's ``CPUOffloadPolicy``, which copies them
    to the device for the gather and the gradients back. A user's own sharding is kept as it is, once
    checked: every parameter must be a DTensor spread over all ranks (``fully_shard``'s default mesh,
    or a 2-D one for HSDP), or gradients would not be summed over the sp ranks that each hold part of them.
    """
    if sharded_per_use(module) or any(isinstance(m, FSDPModule) for m in module.modules()):
        check_user_sharding(module, mesh.size())  # ours from an earlier Trainer run, or the user's
    elif gather == "per_use":
        shard_parameters(module, mesh)
    else:
        policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
        fully_shard(module, mesh=mesh, offload_policy=policy)


def shard_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """Keep 1/world of every parameter on each rank; gather it, inside the compiled step, where it is used.

    Each parameter becomes a ``DTensor`` sharded on dim 0 over ``mesh`` (FSDP2's layout, so optimizers,
    gradient clipping and checkpoints see what they see under ``fully_shard``), and reading it as a
    module attribute returns the gathered tensor::

        module._parameters["weight"]: DTensor [out/W, in] (Shard(0))   # what the optimizer updates
        module.weight:                Tensor  [out, in]                 # all-gather, traced into the graph
        backward:                     reduce-scatter (average over the world) -> weight.grad [out/W, in]

    The all-gather is then an op of the step's graph, right before the parameter's use, and the SAC
    partitioner re-runs it in backward instead of saving the gathered copy (Note [Gathered parameters
    in backward] in ``compiler/partition/parameter_gathers.py``): at most a few layers' parameters are
    whole at any time. This is ZeRO-3 inside a whole-step graph, which FSDP2's hooks cannot give (Note
    [FSDP units under a compiled step]). Parameters shared between modules (tied embeddings) stay shared.
    """
    sharded: dict[int, nn.Parameter] = {}
    gathered_classes: dict[tuple[type, tuple[str, ...]], type] = {}
    for submodule in module.modules():
        names = [name for name, param in submodule._parameters.items() if param is not None]
        if not names:
            continue
        for name in names:
            param = submodule._parameters[name]
            if id(param) not in sharded:
                placement = Shard(0) if param.dim() > 0 else Replicate()
                # A meta parameter has no data to scatter: each rank keeps its shard's shape, and
                # meta_init.materialize fills it later.
                source = None if param.is_meta else 0
                local = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=source)
                sharded[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            submodule._parameters[name] = sharded[id(param)]
        submodule.__class__ = _class_gathering(type(submodule), names, gathered_classes)


def sharded_per_use(module: nn.Module) -> bool:
    """Whether :func:`shard_parameters` has sharded ``module`` (in an earlier Trainer run, say)."""
    return any(isinstance(m, _GatheringModule) for m in module.modules())


def gather_parameter(param: DTensor) -> Tensor:
    """The whole parameter; its gradient is reduce-scattered back to the shard, averaged over ranks."""
    return param.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("avg")])


def _class_gathering(cls: type, names: list[str], cache: dict[tuple[type, tuple[str, ...]], type]) -> type:
    """A subclass of ``cls`` whose parameter attributes read as gathered tensors.

    A class attribute (a property) is found before ``nn.Module.__getattr__`` looks in
    ``_parameters``, so ``module.weight`` gathers while ``state_dict``, ``named_parameters`` and
    optimizers keep the sharded ``nn.Parameter`` under its own name (``torch.nn.utils.parametrize``
    would rename it ``parametrizations.weight.original`` and break checkpoint compatibility).
    """
    key = (cls, tuple(sorted(names)))
    if key not in cache:
        attributes = {name: _gathering_property(name) for name in names}
        cache[key] = type(cls.__name__, (_GatheringModule, cls), attributes)
    return cache[key]


def _gathering_property(name: str) -> property:
    def gathered(module: nn.Module) -> Tensor:
        return gather_parameter(module._parameters[name])

    return property(gathered, doc=f"``{name}`` all-gathered from this rank's shard (data_parallel='fsdp').")


class _GatheringModule:
    """Marks a module class made by :func:`shard_parameters`."""


def unsharded_class(cls: type) -> type:
    """The user's class behind a gathering class of :func:`shard_parameters` (``cls`` for any other)."""
    if issubclass(cls, _GatheringModule):
        return next(base for base in cls.__mro__[1:] if not issubclass(base, _GatheringModule))
    return cls


def check_user_sharding(module: nn.Module, world_size: int) -> None:
    """Raise unless every parameter is sharded over all ``world_size`` ranks; warn on units in containers."""
    unsharded = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    partial = [
        f"{name} (mesh of {p.device_mesh.size()})"
        for name, p in module.named_parameters()
        if isinstance(p, DTensor) and p.device_mesh.size() != world_size
    ]
    if unsharded or partial:
        raise ValueError(
            f"With data_parallel='fsdp' every parameter must be sharded over all {world_size} ranks "
            f"(dp x sp); not sharded: {unsharded[:5]}, sharded over fewer ranks: {partial[:5]}. In "
            "configure_model, call fully_shard(submodule) (default mesh: all ranks) on submodules covering "
            "all parameters, or leave the sharding to the strategy."
        )
    in_containers = [
        f"{name}.{child_name}"
        for name, container in module.named_modules()
        if isinstance(container, nn.ModuleList | nn.ModuleDict | nn.Sequential)
        for child_name, child in container.named_children()
        if isinstance(child, FSDPModule)
    ]
    if in_containers:
        rank_zero_warn(
            f"FSDP units {in_containers[:3]} sit in a module container; FSDP2's hooks are graph breaks, and "
            "one inside a loop over layers makes torch.compile skip that frame, which AutoSP reports as an "
            "error. Shard a submodule the model calls outside its loops, or leave the sharding to the "
            "strategy (data_parallel='fsdp' gathers each parameter where the compiled step uses it)."
        )


def setup_fully_sharded(
    strategy: DDPStrategy,
    trainer: pl.Trainer,
    mesh: DeviceMesh,
    gather: FSDPGather = "per_use",
    *,
    offload: bool = False,
    on_meta: bool = False,
    materialize: Callable[[nn.Module, torch.device], None] | None = None,
) -> None:
    """``DDPStrategy.setup`` with sharding in place of DDP (for evaluation too: the weights stay sharded).

    A module sharded by an earlier Trainer run (fit, then validate) is on its device and in its dtype
    already; moving it again would swap DTensor parameters that compiled code still refers to. A module
    built on the meta device (``on_meta``) is sharded there, and then each rank allocates and initialises
    its shard (``materialize``, from ``meta_init``): no rank holds the whole model.
    """
    strategy.accelerator.setup(trainer)
    if not sharded_per_use(strategy.model):
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        if not on_meta:
            strategy.model_to_device()
    shard_module(strategy.model, mesh, gather, offload=offload)
    if on_meta:
        materialize(strategy.model, strategy.root_device)
        strategy.model_to_device()  # what was built off the meta device
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if fitting:  # the optimizer steps where the shards are: on the host with offload
        _optimizers_to_device(strategy.optimizers, torch.device("cpu") if offload else strategy.root_device)


# ---------------------------------------------------------------------------------------------- checkpoints


def model_state_dict(module: nn.Module, *, full: bool) -> dict[str, Any]:
    """Full (on rank 0; empty elsewhere) or this rank's shards, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=full, cpu_offload=True))


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, *, full: bool, rank: int) -> dict[str, Any]:
    """Like :func:`model_state_dict`; a full one is keyed by parameter index, as a DDP checkpoint is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    options = StateDictOptions(full_state_dict=full, cpu_offload=True)
    state = get_optimizer_state_dict(module, optimizer, options=options)
    if full and rank == 0:
        state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, module)
    return state


def save_distributed_checkpoint(checkpoint: dict[str, Any], path: Path, *, rank: int) -> None:
    """Every rank writes its shards of the weights and optimizer states to the directory ``path``."""
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    shards = {"state_dict": checkpoint.pop("state_dict")}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    _distributed_checkpoint_save(shards, path)
    if rank == 0:
        torch.save(checkpoint, path / _METADATA_FILENAME)


def remove_distributed_checkpoint(path: Path) -> None:
    """A full checkpoint is about to be written where a distributed one (a directory) is."""
    if _is_sharded_checkpoint(path):
        shutil.rmtree(path)


def load_checkpoint(
    path: Path, module: nn.Module, optimizers: Iterable[Optimizer], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load weights and optimizer states in place (full file or distributed directory); return the rest."""
    state: dict[str, Any] = {"state_dict": module}
    state.update({f"optimizer_{i}": optimizer for i, optimizer in enumerate(optimizers)})
    return _load_checkpoint(
        path=path, state=state, strict=strict, optimizer_states_from_list=True, weights_only=weights_only
    )


# ---------------------------------------------------------------------------------------------- memory


def local_state_bytes(module: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (its shards under FSDP)."""

    def nbytes(tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                total += local.numel() * local.element_size()
        return total

    params = list(module.parameters())
    state: list[Any] = []
    for optimizer in optimizers:
        for per_param in getattr(optimizer, "state", {}).values():
            if isinstance(per_param, Mapping):
                state.extend(per_param.values())
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(state),
    }
