"""What the benchmarks share besides measuring a step (that is ``benchmarks.measure``): launching
workers under torchrun, the report's header (command, machine, code), parity against a single device,
AOTAutograd's partitioner log and solver, and c10d's registry of process groups.

Private torch APIs the benchmarks rely on (AOTAutograd's partitioner log and ``solve_min_cut``, c10d's
registry of process groups) are touched in this module and ``benchmarks.measure`` only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20


# --------------------------------------------------------------------------------------------------
# launcher

# What a launcher tells its workers. A benchmark started from a process that holds some of these (a test
# worker in which Lightning ran, a torchrun job) would otherwise take itself for one of our workers.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def is_bench_worker() -> bool:
    """Whether this process is a worker that ``relaunch_under_torchrun`` started (not merely one that
    inherited a rank from whoever started it)."""
    return "LOCAL_RANK" in os.environ and "AUTOSP_BENCH_ARGV" in os.environ


def relaunch_under_torchrun(module: str, argv: list[str], *, nproc: int, threads: int, command: str) -> int:
    """Run ``python -m module argv`` as ``nproc`` torchrun workers from the repository root; the exit code.

    ``command`` (what the user typed) reaches the workers as ``AUTOSP_BENCH_COMMAND`` for the report.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    # The arguments travel in the environment: torchrun's own parser would claim abbreviations of its
    # options among them (``--nproc`` for ``--nproc-per-node``).
    inherited = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "PL_"))
    }
    env = {
        **inherited,
        "AUTOSP_BENCH_COMMAND": command,
        "AUTOSP_BENCH_ARGV": json.dumps(argv),
        "OMP_NUM_THREADS": str(threads),
    }
    env.setdefault("PYTHONWARNINGS", "ignore")
    return subprocess.run([*torchrun, "-m", module], cwd=ROOT, env=env).returncode


def launch_and_time(
    module: str,
    argv: list[str],
    *,
    nproc: int,
    threads: int,
    out: Path,
    write_report: Callable[[dict, Path], None],
) -> int:
    """``relaunch_under_torchrun``, then add the launcher's wall time to the report the workers wrote at
    ``out`` (rewritten with ``write_report``); the exit code."""
    command = f"python -m {module}" + (" " + shlex.join(argv) if argv else "")
    start = time.perf_counter()
    rc = relaunch_under_torchrun(module, argv, nproc=nproc, threads=threads, command=command)
    wall = time.perf_counter() - start
    print(f"\n{command}: exit code {rc}, {wall:.0f} s wall time", flush=True)
    if rc == 0 and out.exists():
        report = json.loads(out.read_text())
        report["wall_s_launcher"] = round(wall, 1)
        write_report(report, out)
    return rc


def launch_or_work(
    module: str,
    argv: list[str],
    args: Any,
    *,
    write_report: Callable[[dict, Path], None],
    work: Callable[[Any], None],
) -> int:
    """From the command line, relaunch ``module`` under torchrun (``launch_and_time``); in a torchrun
    worker, run ``work(args)``. ``args`` carries ``nproc``, ``threads`` and ``out``."""
    if not is_bench_worker():
        return launch_and_time(
            module, argv, nproc=args.nproc, threads=args.threads, out=args.out, write_report=write_report
        )
    sys.path.insert(0, str(ROOT))
    work(args)
    return 0


def render_or_launch(
    module: str,
    argv: list[str],
    parse_args: Callable[[list[str]], Any],
    write_outputs: Callable[[dict, Path], None],
    work: Callable[[Any], None],
) -> int:
    """A torchrun benchmark's entry point: with ``--render``, rewrite the .md from the JSON at ``--out``
    and print it; otherwise ``launch_or_work``. The exit code."""
    argv = worker_argv(argv)
    args = parse_args(argv)
    if args.render:
        write_outputs(json.loads(args.out.read_text()), args.out)
        print(args.out.with_suffix(".md").read_text())
        return 0
    return launch_or_work(module, argv, args, write_report=write_outputs, work=work)


def worker_argv(argv: list[str]) -> list[str]:
    """The arguments of this worker: those ``relaunch_under_torchrun`` passed on, else ``argv``."""
    if is_bench_worker():
        return json.loads(os.environ["AUTOSP_BENCH_ARGV"])
    return argv


def bench_command(module: str, argv: list[str]) -> str:
    return os.environ.get("AUTOSP_BENCH_COMMAND") or shlex.join(["python", "-m", module, *argv])


def report_header(module: str, args: Any, start: float) -> dict:
    """What a benchmark's report starts with: the command, its settings, the machine, the code and the
    seconds since ``start`` (``time.monotonic()``)."""
    return {
        "command": bench_command(module, sys.argv[1:]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
        "code": code_version(),
        "wall_s_worker": round(time.monotonic() - start, 1),
    }


def write_report(report: dict, out: Path, render: Callable[[dict], str]) -> None:
    """``report`` as JSON at ``out`` and rendered as Markdown beside it (``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(report))


def code_version() -> dict:
    """The commit the benchmark ran at, and whether the package had uncommitted changes."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "lightning_autosp_uncommitted_changes": bool(git("status", "--porcelain", "lightning_autosp")),
    }


def machine_info() -> dict:
    import lightning
    import psutil
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    return info


# --------------------------------------------------------------------------------------------------
# parity


def rel_err(a: Any, b: Any) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def current_grads(model: Any) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# A parameter whose true gradient is (numerically) zero cannot be compared relative to itself: the key
# bias of attention gets 1e-11 (softmax ignores a shift shared by a row's scores), all rounding noise.
# Gradients below this fraction of the model's largest are compared against that floor instead.
GRAD_SCALE_FLOOR = 1e-3


def grad_rel_err(grads: dict, reference: dict) -> float:
    """Max over parameters of max|a-b| / max(max|b|, GRAD_SCALE_FLOOR * the largest |b| of any parameter);
    a parameter without a gradient counts as all zeros."""
    import torch

    largest = max((ref.abs().max().item() for ref in reference.values()), default=0.0)
    floor = GRAD_SCALE_FLOOR * largest
    errors = []
    for name, ref in reference.items():
        got = grads.get(name, torch.zeros_like(ref))
        scale = max(ref.abs().max().item(), floor, 1e-12)
        errors.append((got - ref).abs().max().item() / scale)
    return max(errors, default=0.0)


# --------------------------------------------------------------------------------------------------
# AOTAutograd's min-cut partitioner: its log, and swapping its solver


class PartitionerLog(logging.Handler):
    """Records of torch's min-cut partitioner under ``AOT_PARTITIONER_DEBUG``, one dict per graph."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.graphs: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        if message.startswith("Theoretical Per Activation Storage Sizes"):
            self.graphs.append({"saved": [[int(size), str(name)] for size, name in record.args[0]]})
        elif message.startswith("# remat/fw/bw") and self.graphs:
            self.graphs[-1]["remat_fw_bw"] = [int(n) for n in record.args]
        elif message.startswith("Count of Ops Rematerialized") and self.graphs:
            self.graphs[-1]["rematerialized_ops"] = {str(op): int(n) for op, n in record.args[0]}


@contextlib.contextmanager
def partitioner_log() -> Iterator[PartitionerLog]:
    import torch._functorch.partitioners as partitioners

    logger = logging.getLogger(partitioners.__name__)
    handler = PartitionerLog()
    saved = partitioners.AOT_PARTITIONER_DEBUG, logger.level, logger.propagate
    partitioners.AOT_PARTITIONER_DEBUG = True
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        partitioners.AOT_PARTITIONER_DEBUG, _, logger.propagate = saved
        logger.setLevel(saved[1])


def op_of(name: str) -> str:
    """fx node name -> the op it was named after (``mm_3`` -> ``mm``)."""
    return re.sub(r"_\d+$", "", name)


def summarize_partition(graph: dict) -> dict:
    """What the partitioner saved (by producing op, primals apart) and what it recomputes in backward."""
    saved = [(size, name) for size, name in graph["saved"] if not name.startswith("primals")]
    by_op: Counter = Counter()
    for size, name in saved:
        by_op[op_of(name)] += size
    remat = graph.get("rematerialized_ops", {})
    return {
        "estimated_saved_bytes": sum(size for size, _ in saved),
        "saved_values": len(saved),
        "saved_primals": len(graph["saved"]) - len(saved),
        "saved_bytes_by_op": dict(by_op.most_common()),
        "saved": saved,
        "remat_fw_bw": graph.get("remat_fw_bw"),
        "rematerialized_ops": remat,
        "recomputed_attention": sum(n for op, n in remat.items() if "scaled_dot_product" in op),
        "recomputed_collectives": sum(
            n for op, n in remat.items() if op.startswith(("autosp.", "_c10d_functional."))
        ),
    }


def current_solve_min_cut() -> Callable:
    import torch._functorch.partitioners as partitioners

    return partitioners.solve_min_cut


@contextlib.contextmanager
def solve_min_cut_as(solver: Callable) -> Iterator[None]:
    """``torch._functorch.partitioners.solve_min_cut`` is ``solver`` inside the block, the original after.

    DeepSpeed's SAC replaces that function for the whole process; the benchmarks confine it to the
    compiles of the method that uses it.
    """
    import torch._functorch.partitioners as partitioners

    original = partitioners.solve_min_cut
    partitioners.solve_min_cut = solver
    try:
        yield
    finally:
        partitioners.solve_min_cut = original


@contextlib.contextmanager
def registered_process_group(names: Iterable[str], group: Any) -> Iterator[None]:
    """``group`` (a ``torch.distributed.ProcessGroup``, e.g. a Python subclass answering collectives
    in-process) under each of ``names`` in c10d's registry, where functional collectives
    (``torch.ops._c10d_functional``) look their group up, for the block."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    names = list(names)
    for name in names:
        _register_process_group(name, group)
    try:
        yield
    finally:
        for name in names:
            _unregister_process_group(name)


def completed_work(result: Any) -> Any:
    """A finished ``Work`` holding ``result``: what a Python process group's collective returns."""
    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def disable_compile_caches() -> None:
    """Compile for real every time: the FX/AOTAutograd caches key on the graph and config, not on a
    ``solve_min_cut`` swapped in by DeepSpeed, so a DeepSpeed compile could be served another method's
    partition (and the compile times would not be compile times)."""
    import torch

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def set_solve_min_cut(solver: Callable) -> None:
    """Make ``solver`` torch's ``partitioners.solve_min_cut`` again (undoing a process-wide splice)."""
    import torch._functorch.partitioners as partitioners

    partitioners.solve_min_cut = solver
