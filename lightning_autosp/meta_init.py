"""Meta-device initialisation: a model built without memory, sharded, then given each rank's shard.

With ``data_parallel="fsdp"``, a model built on the meta device (``trainer.init_module(empty_init=True)``,
or ``with torch.device("meta")`` in ``configure_model``) is sharded while it is still on meta, and only
then does each rank allocate and initialise its own shard (:func:`materialize`), as with Lightning's
``ModelParallelStrategy``. No rank ever holds the whole model, so a model larger than one device starts.

Note [Materialising sharded parameters]
    Each module that owns meta tensors is initialised on its own: its parameters are swapped for
    whole, plain tensors of their global shape, its initialiser runs (the module's own
    ``reset_parameters``, or, inside a Hugging Face ``PreTrainedModel``, the model's ``_init_weights``,
    which also rebuilds buffers such as rotary frequencies), and each rank copies its own shard of the
    result into the sharded parameter. Only one module's parameters are ever whole (the largest module:
    an embedding table or one projection), and every device gets the same values:

    - DTensor's own random ops would initialise each shard in place, but they are implemented for
      CUDA-like devices only; on the CPU every rank would draw the same numbers for its shard, giving
      a weight made of repeated blocks.
    - Initialising whole modules in ``module.modules()`` order, from the same generator state, draws
      the numbers a single-device build draws when its modules are constructed in that order (true of
      models written as a sequence of submodules; HF models initialise in their own order), so a
      meta-initialised run can be checked against a single device, seed for seed.

    Ranks start from rank 0's generator states (one broadcast), so that every rank computes the same
    whole tensors even without ``seed_everything``; as with a single-device build, the generators
    advance past the initialisation. Floating-point tensors are filled with NaN before their
    initialiser runs, so a tensor no initialiser writes is reported instead of training on whatever
    memory held (load such weights from a checkpoint with ``ckpt_path``, or give the module a
    ``reset_parameters``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_autosp import fsdp


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate every meta parameter and buffer of ``module`` on ``device`` (this rank's shard of a
    sharded one) and initialise it (Note [Materialising sharded parameters]).

    Every rank must call it (it agrees on the generator states first).
    """
    _start_from_rank_zero_generators(device)
    owners = _hf_owners(module)
    uninitialised: list[str] = []
    no_initialiser: set[str] = set()
    names = {id(m): name for name, m in module.named_modules()}
    for submodule in module.modules():
        own = [*submodule.parameters(recurse=False), *submodule.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            continue
        submodule.to_empty(device=device, recurse=False)
        initialise = _initialiser(submodule, owners.get(id(submodule)))
        if initialise is None:
            no_initialiser.add(type(submodule).__name__)
            continue
        with _whole_parameters(submodule, device) as whole:
            for buffer in submodule.buffers(recurse=False):
                if buffer.is_floating_point():
                    buffer.fill_(math.nan)
            initialise()
            untouched = [
                name
                for name, tensor in [
                    *((name, tensor) for name, (tensor, _) in whole.items()),
                    *submodule.named_buffers(recurse=False),
                ]
                if tensor.is_floating_point() and tensor.isnan().any()
            ]
        _keep_local_shards(whole)
        prefix = names[id(submodule)]
        uninitialised.extend(f"{prefix}.{name}" if prefix else name for name in untouched)
    if no_initialiser:
        rank_zero_warn(
            f"Modules of type {sorted(no_initialiser)} were built on the meta device but have no "
            "reset_parameters(), so their parameters and buffers hold uninitialised memory. Define "
            "reset_parameters() on them, or load the weights with trainer.fit(..., ckpt_path=...)."
        )
    if uninitialised:
        rank_zero_warn(
            f"{uninitialised[:8]} were built on the meta device and left NaN by their module's "
            "initialiser. Initialise them in reset_parameters(), or load the weights with "
            "trainer.fit(..., ckpt_path=...)."
        )


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(type(module), "_init_weights", None)) and hasattr(module, "config")


def _hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """For each submodule, the innermost Hugging Face model around it (whose ``_init_weights`` applies)."""
    owners: dict[int, nn.Module] = {}
    for module in root.modules():  # pre-order: an inner model overwrites its outer one
        if _is_hf_model(module):
            owners.update({id(descendant): module for descendant in module.modules()})
    return owners


def _initialiser(module: nn.Module, hf_owner: nn.Module | None) -> Callable[[], object] | None:
    if hf_owner is not None:
        return lambda: hf_owner._init_weights(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


@contextlib.contextmanager
def _whole_parameters(module: nn.Module, device: torch.device) -> Iterator[dict[str, tuple[Tensor, Tensor]]]:
    """Swap ``module``'s own parameters for whole plain tensors (NaN-filled), under the module's own
    class (not the gathering one of ``fsdp.shard_parameters``), for its initialiser.

    Yields {name: (whole tensor, the parameter it stands for)}.
    """
    held = {name: p for name, p in module._parameters.items() if p is not None}
    whole: dict[str, tuple[Tensor, Tensor]] = {}
    for name, param in held.items():
        tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        whole[name] = (nn.Parameter(tensor, requires_grad=param.requires_grad), param)
    cls = type(module)
    module._parameters.update({name: tensor for name, (tensor, _) in whole.items()})
    module.__class__ = fsdp.unsharded_class(cls)
    try:
        yield whole
    finally:
        module.__class__ = cls
        module._parameters.update(held)


@torch.no_grad()
def _keep_local_shards(whole: dict[str, tuple[Tensor, Tensor]]) -> None:
    """Copy this rank's shard of each whole tensor into the parameter it stands for."""
    for tensor, target in whole.values():
        if isinstance(target, DTensor):
            local = distribute_tensor(
                tensor.detach(), target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(tensor)


def _generator_states(device: torch.device) -> list[Tensor]:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def _start_from_rank_zero_generators(device: torch.device) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    states = [_generator_states(device)]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0][0])
    if device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(states[0][1], device)
