"""Launch a multi-process job with ``torchrun`` from a test, without leaving processes behind."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
        # torchrun starts each worker in a session of its own, and a worker blocked in a collective
        # ignores SIGTERM: kill every process of the job by pid.
        for child in [*psutil.Process(process.pid).children(recursive=True), process]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                child.kill()
        _, stderr = process.communicate()
        pytest.fail(f"the job hung: still running after {timeout:.0f} s\n{stderr[-6000:]}")
    return process.returncode, stderr, time.monotonic() - start
