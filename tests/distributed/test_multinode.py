"""Multi-node launch through Lightning's own cluster environments, "nodes" simulated on one machine.

- torchrun: one ``torchrun --nnodes=2 --node_rank=k --nproc_per_node=2`` per node (static rendezvous);
  Lightning selects ``TorchElasticEnvironment``. sp=2 <= 2 devices per node: each sp group must stay
  inside a node. Runs the dp=2 x sp=2 ``data_parallel="fsdp"`` parity case.
- SLURM: one process per task with the variables ``srun`` sets, ``--nodes=2 --ntasks-per-node=1``;
  Lightning selects ``SLURMEnvironment``. sp=2 > 1 device per node: the sp group spans both nodes.

The worker (``multinode_worker.py``) leaves process-group initialisation to the Trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import failures, slurm_tasks, torchrun_nodes

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("multinode_worker.py")
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4


def results(out: Path, world: int, case: str) -> dict[int, dict]:
    found = {}
    for rank in range(world):
        result = json.loads((out / f"rank{rank}.json").read_text())[case]
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result.get('traceback')}"
        found[rank] = result
    return found


@pytest.fixture(scope="module")
def torchrun_two_nodes(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("torchrun_nodes")
    args = ["--out", str(out), "--num-nodes", "2", "--devices", "2", "--cases", "fsdp_dp2_sp2"]
    codes, stderr, _ = torchrun_nodes(2, 2, WORKER, *args, timeout=900)
    assert codes == [0, 0], failures(codes, stderr)
    return results(out, 4, "fsdp_dp2_sp2")


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("slurm_nodes")
    args = ["--out", str(out), "--num-nodes", "2", "--devices", "1", "--cases", "gpt_shift"]
    codes, stderr, _ = slurm_tasks(2, 1, WORKER, *args, timeout=900)
    assert codes == [0, 0], failures(codes, stderr)
    return results(out, 2, "gpt_shift")


def assert_parity(found: dict[int, dict]) -> None:
    for rank, result in found.items():
        assert result["attention_found"] > 0, rank
        assert not result["missing_grads"], rank
        assert result["loss_rel_err"] <= LOSS_TOLERANCE, (rank, result)
        assert result["grad_rel_err"] <= GRAD_TOLERANCE, (rank, result)


@pytest.mark.timeout(960)
def test_torchrun_nodes_give_lightning_ranks_node_by_node(torchrun_two_nodes):
    for rank, result in torchrun_two_nodes.items():
        assert result["environment"] == "TorchElasticEnvironment"
        assert result["world_size"] == 4
        assert (result["node_rank"], result["local_rank"]) == divmod(rank, 2)


@pytest.mark.timeout(960)
def test_sp_groups_are_contiguous_and_inside_a_node(torchrun_two_nodes):
    for rank, result in torchrun_two_nodes.items():
        first = rank - rank % 2
        assert result["sp_group"] == [first, first + 1], rank
        assert {result["node_of_rank"][r] for r in result["sp_group"]} == {result["node_rank"]}


@pytest.mark.timeout(960)
def test_fsdp_dp2_sp2_across_two_nodes_equals_one_device(torchrun_two_nodes):
    assert_parity(torchrun_two_nodes)
    assert all(result["sharded"] for result in torchrun_two_nodes.values())


@pytest.mark.timeout(960)
def test_slurm_variables_select_lightnings_slurm_environment(slurm_two_nodes):
    for rank, result in slurm_two_nodes.items():
        assert result["environment"] == "SLURMEnvironment"
        assert (result["world_size"], result["node_rank"], result["local_rank"]) == (2, rank, 0)


@pytest.mark.timeout(960)
def test_an_sp_group_wider_than_a_node_spans_nodes_and_stays_exact(slurm_two_nodes):
    for result in slurm_two_nodes.values():
        assert result["sp_group"] == [0, 1]
        assert result["node_of_rank"] == [0, 1]
    assert_parity(slurm_two_nodes)
