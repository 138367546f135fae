"""Measurements shared by the benchmarks (``benchmarks.sac``, ``benchmarks.run``).

Every function here runs one step of training the way the caller defines it: ``forward()`` returns the
loss with its autograd graph, ``backward(loss)`` runs backward (and whatever gradient synchronisation
the method needs). Nothing here knows about sequence parallelism.

Private torch APIs the benchmarks rely on (the profiler's event tree, AOTAutograd's partitioner log
and ``solve_min_cut``, c10d's registry of process groups) are touched in this module only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
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
BACKWARD_MARK = "benchmarks:backward"

Forward = Callable[[], Any]
Backward = Callable[[Any], None]


def _plain_backward(loss: Any) -> None:
    loss.backward()


# --------------------------------------------------------------------------------------------------
# launcher


def relaunch_under_torchrun(module: str, argv: list[str], *, nproc: int, threads: int, command: str) -> int:
    """Run ``python -m module argv`` as ``nproc`` torchrun workers from the repository root; the exit code.

    ``command`` (what the user typed) reaches the workers as ``AUTOSP_BENCH_COMMAND`` for the report.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    # The arguments travel in the environment: torchrun's own parser would claim abbreviations of its
    # options among them (``--nproc`` for ``--nproc-per-node``).
    env = {
        **os.environ,
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
    if "LOCAL_RANK" not in os.environ:
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
    if "LOCAL_RANK" in os.environ and "AUTOSP_BENCH_ARGV" in os.environ:
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
# bytes saved for backward


def _compiled_nodes(loss: Any) -> list:
    """Every ``CompiledFunctionBackward`` node of the autograd graph behind ``loss``."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def saved_for_backward(forward: Forward, model: Any, backward: Backward = _plain_backward) -> dict:
    """Bytes of the distinct storages autograd keeps for backward during ``forward()``, parameters excluded.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``, which sees AOTAutograd's
    ``ctx.save_for_backward`` as well as eager autograd. ``hook_check`` compares the hooked tensors with
    ``grad_fn.saved_tensors`` of every ``CompiledFunctionBackward`` node and lists tensors a compiled
    node saved outside the hook (``_tensors_no_vc_check``; added to the count).
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed: list = []

    def pack(tensor: Any) -> Any:
        packed.append(tensor)
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    nodes = _compiled_nodes(loss)
    ctx_saved = [t for node in nodes for t in node.saved_tensors]
    unhooked = [t for node in nodes for t in getattr(node, "_tensors_no_vc_check", ())]

    def storages(tensors: list) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    hooked = storages(packed)
    activations = {ptr: size for ptr, size in {**hooked, **storages(unhooked)}.items() if ptr not in params}
    result = {
        "saved_bytes": sum(activations.values()),
        "saved_storages": len(activations),
        "saved_tensors": len(packed) + len(unhooked),
        "parameter_tensors_saved": sum(ptr in params for ptr in hooked),
        "hook_check": {
            "loss_grad_fn": type(loss.grad_fn).__name__,
            "compiled_nodes": len(nodes),
            "hooked_tensors": len(packed),
            "ctx_saved_tensors": len(ctx_saved),
            "tensors_saved_outside_hook": len(unhooked),
            "same_storages": set(hooked) == set(storages(ctx_saved)),
        },
    }
    result["hook_check"]["ok"] = bool(
        nodes and len(packed) == len(ctx_saved) and not unhooked and result["hook_check"]["same_storages"]
    )
    backward(loss)
    return result


# --------------------------------------------------------------------------------------------------
# peak memory and collectives of one step

_COLLECTIVE = re.compile(r"^(gloo|nccl|ucc|mpi|xccl):([a-z_]+)$")


def _collective_record(event: Any, backward_start: int | None) -> tuple[str, str, int] | None:
    """(phase, collective, input bytes) of a process-group event such as ``gloo:all_to_all``."""
    match = _COLLECTIVE.match(event.name)
    if not match:
        return None
    nbytes = 0
    for value in getattr(event.extra_fields, "inputs", ()):
        sizes = getattr(value, "sizes", None)
        if sizes is not None:
            numel = 1
            for size in sizes:
                numel *= size
            nbytes += numel * _itemsize(value.dtype)
            break  # the first tensor is the one sent
    phase = "forward" if backward_start is None or event.start_time_ns < backward_start else "backward"
    return phase, match.group(2), nbytes


def collective_bytes(profiler: Any) -> dict[str, int]:
    """Bytes each rank passed to each kind of collective (``all_gather``, ...) in a finished profile
    (recorded with ``record_shapes=True``)."""
    totals: Counter = Counter()
    for event in profile_events(profiler):
        record = _collective_record(event, None)
        if record:
            totals[record[1]] += record[2]
    return dict(totals)


def profile_events(profiler: Any) -> Iterator[Any]:
    """Every event of a finished profile, nested ones included."""
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def _cpu_allocation(event: Any) -> tuple[int, int, int] | None:
    """``(time, size, address)`` of a CPU allocator event (a free has a negative size), else None."""
    from torch._C._profiler import _EventType

    if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
        return event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr
    return None


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def bytes_held(allocations: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, int]]:
    """``(time, bytes held)`` after each CPU allocator event ``(time, size, address)`` (a free has a negative
    size). Events are matched by address, so blocks allocated before the profile, and their frees, are left
    out; an address allocated again counts as freed."""
    live: dict[int, int] = {}
    held = 0
    for when, size, ptr in sorted(allocations):
        held -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            held += size
        yield when, held


Allocation = tuple[int, int, int]  # (time, size, address) of an allocator event; a free has a negative size


def unseen_frees(allocations: Iterable[Allocation], kept: Iterable[int]) -> set[Allocation]:
    """The allocations whose free no event shows: their address is allocated again, or they are still held
    when the profile ends and are not ``kept`` (addresses the caller knows are held then, the gradients).
    A tensor whose last reference goes away on a thread the profiler does not record is freed there without
    an event: gloo's worker still holds a work's input and output when ``wait_tensor`` returns."""
    live: dict[int, Allocation] = {}
    unseen = set()
    for allocation in sorted(allocations):
        _, size, ptr = allocation
        previous = live.pop(ptr, None)
        if size > 0:
            if previous is not None:
                unseen.add(previous)
            live[ptr] = allocation
    held_at_end = set(kept)
    return unseen | {allocation for ptr, allocation in live.items() if ptr not in held_at_end}


def cpu_allocation_peak(profiler: Any, kept: Iterable[int] | None = None) -> int:
    """High-water mark of the CPU allocator's bytes allocated (and still held) in a finished profile.

    With ``kept``, the blocks whose free no event shows are left out (``unseen_frees``): a lower bound on
    the step's own peak where the plain mark, which holds such a block until its address is reused, is an
    upper one."""
    allocations = [a for a in map(_cpu_allocation, profile_events(profiler)) if a is not None]
    if kept is not None:
        unseen = unseen_frees(allocations, kept)
        allocations = [a for a in allocations if a not in unseen]
    return max((held for _, held in bytes_held(allocations)), default=0)


def profiled_step(forward: Forward, backward: Backward = _plain_backward) -> dict:
    """One step under the profiler: c10 CPU allocator high-water mark and the collectives it ran.

    Allocation and free events of the CPU allocator are matched by address; blocks allocated before the
    step are left out (so are their frees). A tensor whose last reference goes away on a gloo worker
    thread is freed without a recorded event (the profiler records on the threads it runs on), so a single
    step can over-count by a few MiB (callers take the least of several steps); an address that is
    allocated again counts as freed. Collectives are the process-group events (``gloo:all_to_all``,
    ``nccl:all_reduce``, ...) with the bytes of the tensor each rank passes in, split at the start of
    backward.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        loss = forward()
        with record_function(BACKWARD_MARK):
            backward(loss)
    allocations, ops, backward_start = [], [], None
    for event in profile_events(prof):
        allocation = _cpu_allocation(event)
        if allocation is not None:
            allocations.append(allocation)
        elif event.name == BACKWARD_MARK:
            backward_start = event.start_time_ns
        elif _COLLECTIVE.match(event.name):
            ops.append(event)
    peak = end_of_forward = 0
    for when, held in bytes_held(allocations):
        peak = max(peak, held)
        if backward_start is None or when < backward_start:
            end_of_forward = held
    collectives: Counter = Counter()
    calls: Counter = Counter()
    for event in ops:
        record = _collective_record(event, backward_start)
        if record:
            phase, name, nbytes = record
            collectives[f"{phase}:{name}"] += nbytes
            calls[f"{phase}:{name}"] += 1
    return {
        "alloc_peak_bytes": peak,
        "alloc_end_of_forward_bytes": end_of_forward,
        "collective_bytes": dict(collectives),
        "collective_calls": dict(calls),
        "loss": loss,
    }


def allocator_peak(
    forward: Forward, model: Any, backward: Backward = _plain_backward, steps: int = 3
) -> dict:
    """The least ``alloc_peak_bytes`` of ``steps`` profiled steps (gradients set to None before each)."""
    runs = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        run = profiled_step(forward, backward)
        run.pop("loss")
        runs.append(run)
    best = min(runs, key=lambda run: run["alloc_peak_bytes"])
    return {**best, "alloc_peak_bytes_all_steps": [run["alloc_peak_bytes"] for run in runs]}


def cuda_peak(forward: Forward, model: Any, backward: Backward = _plain_backward) -> dict:
    """CUDA caching-allocator high-water mark of one step above what was allocated at its start."""
    import torch

    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = forward()
    end_of_forward = torch.cuda.memory_allocated() - base
    backward(loss)
    torch.cuda.synchronize()
    return {
        "alloc_peak_bytes": torch.cuda.max_memory_allocated() - base,
        "alloc_end_of_forward_bytes": end_of_forward,
        "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
    }


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else -1


def rss_peak(step: Callable[[], Any], model: Any) -> dict:
    """Process RSS high-water mark during ``step()``, above the RSS at its start (Linux only).

    Freed heap memory is handed back to the OS first (glibc ``malloc_trim``), so that the step's
    allocations show as RSS growth instead of reusing memory the process already holds.
    """
    model.zero_grad(set_to_none=True)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_bytes("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        step()
        return {"rss_peak_delta_bytes": None}
    step()
    return {"rss_peak_delta_bytes": _status_bytes("VmHWM") - before}


def memtracker_check(forward: Forward) -> dict:
    """Does a compiled step still run compiled under MemTracker? (No: Dynamo skips frames under modes.)"""
    from torch.distributed._tools.mem_tracker import MemTracker

    with MemTracker():
        under = type(forward().grad_fn).__name__
    after = type(forward().grad_fn).__name__
    return {
        "loss_grad_fn_under_memtracker": under,
        "loss_grad_fn_after_memtracker": after,
        "ran_compiled": under == "CompiledFunctionBackward",
    }


def timed(fn: Callable[[], Any], cuda: bool = False) -> float:
    """Wall seconds of ``fn()``, with the GPU drained before and after when ``cuda``."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


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
