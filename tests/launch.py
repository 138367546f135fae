"""Launch a multi-process job with ``torchrun`` from a test, without leaving processes behind, and end its
workers once their results are written."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import psutil
import pytest
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kill_tree(process: subprocess.Popen) -> None:
    """Kill ``process`` and all its descendants by pid: torchrun starts each worker in a session of its
    own, and a worker blocked in a collective ignores SIGTERM."""
    for child in [*psutil.Process(process.pid).children(recursive=True), process]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            child.kill()


def end_worker(barrier: bool = True) -> NoReturn:
    """End a worker whose results are on disk: wait for every rank (unless ``barrier=False``, for a worker
    whose last check may leave the group unusable), then leave without interpreter teardown.

    torch keeps gloo groups alive past ``destroy_process_group`` (held from C++ once a functional collective
    or FSDP has used them: on torch 2.13, weak references show the world and sub-groups alive after destroy
    and ``gc.collect()``, in a plain script as in our workers), so they are destroyed and their threads joined
    only as the process tears down, which can abort it (SIGABRT) after its work is done; two launches have
    failed so (pytorch/pytorch#179291 describes it). The job's outcome is in its results; the exit code says
    only that the worker got that far.
    """
    if dist.is_initialized():
        if barrier:
            dist.barrier()  # no rank closes its connections while another still waits on them
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(ranks: int, script: Path, *args: str, timeout: float) -> tuple[int, str, float]:
    """(return code, stderr, seconds). Past ``timeout`` every process of the job is killed: no orphans."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        _, stderr = process.communicate()
        pytest.fail(f"the job hung: still running after {timeout:.0f} s\n{stderr[-6000:]}")
    return process.returncode, stderr, time.monotonic() - start


def _wait_all(processes: list[subprocess.Popen], timeout: float, start: float) -> tuple[list[int], list[str]]:
    """Return code and stderr of each process; past ``timeout`` every process and child is killed."""
    stderr = []
    try:
        for process in processes:
            _, err = process.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
            stderr.append(err)
    except subprocess.TimeoutExpired:
        for process in processes:
            kill_tree(process)
        pytest.fail(f"the job hung: still running after {timeout:.0f} s")
    return [process.returncode for process in processes], stderr


def failures(codes: list[int], stderr: list[str], tail: int = 5000) -> str:
    """The end of each failed process's stderr under its index and return code. A process that fails first
    makes the others fail after it; joined output would show only the last one's end, not the cause."""
    return "\n".join(
        f"----- process {index}: return code {code} -----\n{err[-tail:]}"
        for index, (code, err) in enumerate(zip(codes, stderr, strict=True))
        if code != 0
    )


def torchrun_nodes(
    nodes: int, ranks_per_node: int, script: Path, *args: str, timeout: float
) -> tuple[list[int], list[str], float]:
    """One ``torchrun --nnodes=nodes --node_rank=k`` per "node", all on this machine (static rendezvous).

    (return code and stderr per node, seconds); the same no-orphans rule as :func:`torchrun`.
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--node_rank={node}",
                f"--nproc_per_node={ranks_per_node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(script),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in range(nodes)
    ]
    codes, stderr = _wait_all(processes, timeout, start)
    return codes, stderr, time.monotonic() - start


def slurm_tasks(
    nodes: int, tasks_per_node: int, script: Path, *args: str, timeout: float
) -> tuple[list[int], list[str], float]:
    """One process per task, with the environment ``srun`` gives it (``--nodes``, ``--ntasks-per-node``).

    Lightning's ``SLURMEnvironment`` reads ranks from these variables; MASTER_ADDR/MASTER_PORT are set as an
    sbatch script does. (return code and stderr per task, seconds).
    """
    world = nodes * tasks_per_node
    torchrun_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    inherited = ("SLURM_", "TORCHELASTIC_")
    base = {k: v for k, v in os.environ.items() if k not in torchrun_vars and not k.startswith(inherited)}
    base.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="autosp-test",
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(world),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_NODELIST="127.0.0.1",
    )
    start = time.monotonic()
    processes = []
    for rank in range(world):
        node, local = divmod(rank, tasks_per_node)
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
        command = [sys.executable, str(script), *args]
        processes.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        )
    codes, stderr = _wait_all(processes, timeout, start)
    return codes, stderr, time.monotonic() - start
