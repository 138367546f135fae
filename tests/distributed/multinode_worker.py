"""Multi-node launch through Lightning's cluster environments (torchrun, SLURM), "nodes" on one machine.

``tests/launch.py`` starts the processes as a launcher would: one ``torchrun --nnodes=N --node_rank=k`` per
node (Lightning selects ``TorchElasticEnvironment``), or one process per task with the variables ``srun``
sets (``SLURMEnvironment``). The worker does not initialise torch.distributed itself: the Trainer does,
from the environment, given ``num_nodes`` and ``devices`` as a user passes them. Every rank records the
environment Lightning chose, its ranks, its sp group and loss/gradient parity with a single device for each
case of ``parity_worker.CASES``. Results go to ``<out>/rank<r>.json``.

    torchrun --nnodes=2 --node_rank=K --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=P \\
        tests/distributed/multinode_worker.py --out DIR --num-nodes 2 --devices 2 --cases fsdp_dp2_sp2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import grad_rel_err  # noqa: E402
from lightning_autosp import AutoSPStrategy  # noqa: E402
from lightning_autosp.mesh import SP  # noqa: E402
from tests.distributed.parity_worker import (  # noqa: E402
    CASES,
    Capture,
    make_samples,
    one_step_trainer,
    single_device_reference,
)
from tests.launch import end_worker  # noqa: E402


def run(name: str, num_nodes: int, devices: int) -> dict:
    case = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = case.module(**case.module_kwargs)
    strategy = AutoSPStrategy(sp_size=case.sp_size, **{"compiler": "aot_eager", **case.strategy_kwargs})
    capture = Capture()
    trainer = one_step_trainer(case, strategy, capture, num_nodes=num_nodes, devices=devices)
    world, rank = trainer.world_size, trainer.global_rank
    dp = world // case.sp_size
    samples = make_samples(case, dp * case.batch_size)
    trainer.fit(module, DataLoader(samples, batch_size=case.batch_size, shuffle=False))

    torch.manual_seed(0)
    losses, grads = single_device_reference(case, case.module(**case.module_kwargs), samples, dp)
    reference_loss = losses[rank // case.sp_size]
    nodes: list[int | None] = [None] * world
    dist.all_gather_object(nodes, trainer.node_rank)
    return {
        "environment": type(strategy.cluster_environment).__name__,
        "world_size": world,
        "global_rank": rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "node_of_rank": nodes,
        "sp_group": dist.get_process_group_ranks(strategy.device_mesh.get_group(SP)),
        "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "loss_rel_err": abs(capture.loss - reference_loss) / abs(reference_loss),
        "grad_rel_err": grad_rel_err(capture.grads, grads),
        "missing_grads": sorted(set(grads) - set(capture.grads)),
        "attention_found": sum(b.attention_count for b in strategy.backends.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    args = parser.parse_args()
    results = {}
    for name in args.cases:
        try:
            results[name] = run(name, args.num_nodes, args.devices)
        except Exception as error:  # recorded per case; the test shows it
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK") or os.environ["SLURM_PROCID"]
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    end_worker()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
