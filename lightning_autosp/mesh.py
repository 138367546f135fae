"""The data-parallel x sequence-parallel device mesh.

Ranks are laid out row-major over ("dp", "sp"): the ranks of one sp group are contiguous, so with
one process per GPU an sp group stays inside a node whenever sp_size divides the GPUs per node,
where the all-to-all runs over NVLink rather than the network.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import GroupMember
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

DP, SP = "dp", "sp"


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
