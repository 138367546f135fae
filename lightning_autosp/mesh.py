"""The data-parallel x sequence-parallel device mesh.

Ranks are laid out row-major over ("dp", "sp"): the ranks of one sp group are contiguous, so with
one process per GPU an sp group stays inside a node whenever sp_size divides the GPUs per node,
where the all-to-all runs over NVLink rather than the network.
"""

from __future__ import annotations

from datetime import timedelta

from torch import nn
from torch.distributed import GroupMember
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

DP, SP = "dp", "sp"
RING, ULYSSES = "ring", "ulysses"


def check_positive_sp_size(sp_size: object) -> None:
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}.")


def check_sp_size(world_size: int, sp_size: int) -> None:
    """Raise before any collective when ``sp_size`` cannot tile the world."""
    check_positive_sp_size(sp_size)
    if world_size % sp_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"sp_size={sp_size} must divide the world size ({world_size} processes); use one of {divisors}, "
            "or change the number of devices/nodes."
        )


def build_dp_sp_mesh(
    device_type: str, world_size: int, sp_size: int, timeout: timedelta | None = None
) -> DeviceMesh:
    """A 2-D mesh (dp = world_size / sp_size, sp = sp_size) over all ranks; sp groups are contiguous.

    ``timeout`` applies to the mesh's sub-groups too: DeviceMesh creates them with torch's default
    (30 min for gloo), so the peers of a stuck rank would otherwise wait that long.
    """
    check_sp_size(world_size, sp_size)
    mesh = init_device_mesh(device_type, (world_size // sp_size, sp_size), mesh_dim_names=(DP, SP))
    if timeout is not None:
        for dim in (DP, SP):
            group = mesh.get_group(dim)
            if group is not GroupMember.WORLD:
                _set_pg_timeout(timeout, group)
    return mesh


def check_ulysses_degree_option(ulysses_degree: object) -> None:
    """``ulysses_degree`` is None (all of sp), "auto" or a positive integer (checked before launch)."""
    if ulysses_degree is None or ulysses_degree == "auto":
        return
    if not isinstance(ulysses_degree, int) or isinstance(ulysses_degree, bool) or ulysses_degree < 1:
        raise ValueError(
            f"ulysses_degree must be a positive integer, 'auto' or None, got {ulysses_degree!r}."
        )


def check_ulysses_degree(sp_size: int, ulysses_degree: int) -> None:
    """Raise before any collective when ``ulysses_degree`` x ring degree cannot make ``sp_size``."""
    if sp_size % ulysses_degree:
        divisors = [d for d in range(1, sp_size + 1) if sp_size % d == 0]
        raise ValueError(
            f"ulysses_degree={ulysses_degree} must divide sp_size={sp_size} (sp_size = ulysses_degree x "
            f"ring degree); use one of {divisors} or ulysses_degree='auto'."
        )


def auto_ulysses_degree(sp_size: int, heads: int, devices_per_node: int) -> int:
    """The largest Ulysses degree that divides ``sp_size``, the q heads and the devices per node.

    The all-to-all then runs over contiguous ranks inside a node and the rest of sp becomes the ring,
    whose K/V passing is the one that may cross nodes.
    """
    return max(
        d for d in range(1, sp_size + 1) if sp_size % d == 0 and heads % d == 0 and devices_per_node % d == 0
    )


_HEAD_ATTRIBUTES = ("num_attention_heads", "num_heads", "n_head", "n_heads", "heads")


def find_head_counts(module: nn.Module) -> set[int]:
    """Attention head counts named on ``module``'s submodules or their configs (HF ``config``, litgpt,
    ``nn.MultiheadAttention``, ``heads`` attributes), for ``ulysses_degree="auto"``.

    A guess from names: the SP pass checks the heads of every attention it rewrites and raises if the
    chosen Ulysses degree does not divide them.
    """
    counts = set()
    for submodule in module.modules():
        for owner in (submodule, getattr(submodule, "config", None)):
            for name in _HEAD_ATTRIBUTES:
                value = getattr(owner, name, None) if owner is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    counts.add(value)
                    break
    return counts


def build_ring_ulysses_mesh(
    device_type: str, world_size: int, sp_size: int, ulysses_degree: int, timeout: timedelta | None = None
) -> DeviceMesh:
    """A 3-D mesh (dp, ring, ulysses) that splits each sp group into ring x Ulysses sub-groups.

    Ulysses is the inner dim: an sp rank r is ring rank r // ulysses_degree and Ulysses rank
    r % ulysses_degree, so a Ulysses group is ``ulysses_degree`` contiguous ranks (the ones the
    all-to-all connects; Note [Ring layouts] in data.py). Sub-groups get ``timeout`` like
    :func:`build_dp_sp_mesh`'s.
    """
    check_sp_size(world_size, sp_size)
    check_ulysses_degree(sp_size, ulysses_degree)
    shape = (world_size // sp_size, sp_size // ulysses_degree, ulysses_degree)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=(DP, RING, ULYSSES))
    if timeout is not None:
        for dim in (DP, RING, ULYSSES):
            group = mesh.get_group(dim)
            if group is not GroupMember.WORLD:
                _set_pg_timeout(timeout, group)
    return mesh


def ring_group_names(ring_mesh: DeviceMesh | None) -> dict[str, str]:
    """The names of the Ulysses and ring sub-groups of this rank's sp group, as ``SPContext`` takes them
    (none without ring attention)."""
    if ring_mesh is None:
        return {}
    return {
        "ulysses_group_name": ring_mesh.get_group(ULYSSES).group_name,
        "ring_group_name": ring_mesh.get_group(RING).group_name,
    }
