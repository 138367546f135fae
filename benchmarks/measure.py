"""What one training step costs, measured: bytes saved for backward, the allocator's peak, the bytes of
its collectives, its wall time.

Every function here runs one step the way the caller defines it: ``forward()`` returns the loss with its
autograd graph, ``backward(loss)`` runs backward (and whatever gradient synchronisation the method
needs). Nothing here knows about sequence parallelism.

The profiler's event tree and its allocator events (private torch APIs) are read in this module only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

BACKWARD_MARK = "benchmarks:backward"

Forward = Callable[[], Any]
Backward = Callable[[Any], None]
Allocation = tuple[int, int, int]  # (time, size, address) of an allocator event; a free has a negative size


def _plain_backward(loss: Any) -> None:
    loss.backward()


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


def cpu_allocation(event: Any) -> Allocation | None:
    """``(time, size, address)`` of a CPU allocator event (a free has a negative size), else None."""
    from torch._C._profiler import _EventType

    if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
        return event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr
    return None


def step_events(profiler: Any) -> tuple[dict[Allocation, Any], int | None, list[Any]]:
    """One walk of a finished step's profile: its CPU allocator events (each under its ``cpu_allocation``),
    the start of backward (the ``BACKWARD_MARK`` range, None without one) and its process-group events."""
    allocations: dict[Allocation, Any] = {}
    backward_start, collectives = None, []
    for event in profile_events(profiler):
        allocation = cpu_allocation(event)
        if allocation is not None:
            allocations[allocation] = event
        elif event.name == BACKWARD_MARK:
            backward_start = event.start_time_ns
        elif _COLLECTIVE.match(event.name):
            collectives.append(event)
    return allocations, backward_start, collectives


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def cpu_allocations(profiler: Any) -> list[Allocation]:
    """Every CPU allocator event of a finished profile."""
    return [allocation for allocation in map(cpu_allocation, profile_events(profiler)) if allocation]


def replay(
    allocations: Iterable[Allocation],
) -> Iterator[tuple[Allocation, Allocation | None, int, dict[int, Allocation]]]:
    """The allocator's state after each event, in time order: ``(event, block it released, bytes held, blocks
    held by address)``. Events are matched by address, so blocks allocated before the profile, and their
    frees, are left out; an address allocated again releases the block that held it. The dict is updated in
    place: copy it to keep it."""
    live: dict[int, Allocation] = {}
    held = 0
    for allocation in sorted(allocations):
        _, size, ptr = allocation
        released = live.pop(ptr, None)
        if released is not None:
            held -= released[1]
        if size > 0:
            live[ptr] = allocation
            held += size
        yield allocation, released, held, live


def bytes_held(allocations: Iterable[Allocation]) -> Iterator[tuple[int, int]]:
    """``(time, bytes held)`` after each CPU allocator event (``replay``)."""
    for (when, _, _), _, held, _ in replay(allocations):
        yield when, held


def unseen_frees(allocations: Iterable[Allocation], kept: Iterable[int]) -> set[Allocation]:
    """The allocations whose free no event shows: their address is allocated again, or they are still held
    when the profile ends and are not ``kept`` (addresses the caller knows are held then, the gradients).
    A tensor whose last reference goes away on a thread the profiler does not record is freed there without
    an event: gloo's worker still holds a work's input and output when ``wait_tensor`` returns."""
    unseen: set[Allocation] = set()
    at_end: dict[int, Allocation] = {}
    for allocation, released, _, live in replay(allocations):
        if allocation[1] > 0 and released is not None:
            unseen.add(released)
        at_end = live
    held_at_end = set(kept)
    return unseen | {allocation for ptr, allocation in at_end.items() if ptr not in held_at_end}


def allocation_peak(allocations: Iterable[Allocation], kept: Iterable[int] | None = None) -> int:
    """High-water mark of the bytes held (``bytes_held``).

    With ``kept``, the blocks whose free no event shows are left out (``unseen_frees``): a lower bound on
    the step's own peak where the plain mark, which holds such a block until its address is reused, is an
    upper one."""
    allocations = list(allocations)
    if kept is not None:
        unseen = unseen_frees(allocations, kept)
        allocations = [a for a in allocations if a not in unseen]
    return max((held for _, held in bytes_held(allocations)), default=0)


def cpu_allocation_peak(profiler: Any, kept: Iterable[int] | None = None) -> int:
    """``allocation_peak`` of a finished profile's CPU allocator events."""
    return allocation_peak(cpu_allocations(profiler), kept)


def gradient_storages(model: Any) -> set[int]:
    """Addresses of the storages of ``model``'s gradients: blocks a step leaves held at its end on purpose."""
    return {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}


def profiled_step(forward: Forward, backward: Backward = _plain_backward, model: Any = None) -> dict:
    """One step under the profiler: c10 CPU allocator high-water mark and the collectives it ran.

    Allocation and free events of the CPU allocator are matched by address; blocks allocated before the
    step are left out (so are their frees). A tensor whose last reference goes away on a gloo worker
    thread is freed without a recorded event (the profiler records on the threads it runs on), so a single
    step can over-count by a few MiB (callers take the least of several steps); an address that is
    allocated again counts as freed. Collectives are the process-group events (``gloo:all_to_all``,
    ``nccl:all_reduce``, ...) with the bytes of the tensor each rank passes in, split at the start of
    backward.

    With ``model``, also ``alloc_peak_seen_frees_bytes``: the peak without the blocks whose free no event
    shows (``allocation_peak`` with the gradients as the blocks known to be held at the end), a lower bound
    where ``alloc_peak_bytes`` is an upper one.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        loss = forward()
        with record_function(BACKWARD_MARK):
            backward(loss)
    events, backward_start, ops = step_events(prof)
    allocations = list(events)
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
    figures = {
        "alloc_peak_bytes": peak,
        "alloc_end_of_forward_bytes": end_of_forward,
        "collective_bytes": dict(collectives),
        "collective_calls": dict(calls),
        "loss": loss,
    }
    if model is not None:
        figures["alloc_peak_seen_frees_bytes"] = allocation_peak(allocations, kept=gradient_storages(model))
    return figures


def allocator_peak(
    forward: Forward, model: Any, backward: Backward = _plain_backward, steps: int = 3
) -> dict:
    """The least ``alloc_peak_bytes`` of ``steps`` profiled steps (gradients set to None before each), with
    every step's peak and lower bound (``profiled_step``) beside it; the least lower bound is
    ``alloc_peak_seen_frees_bytes``."""
    runs = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        run = profiled_step(forward, backward, model)
        run.pop("loss")
        runs.append(run)
    best = min(runs, key=lambda run: run["alloc_peak_bytes"])
    return {
        **best,
        "alloc_peak_seen_frees_bytes": min(run["alloc_peak_seen_frees_bytes"] for run in runs),
        "alloc_peak_bytes_all_steps": [run["alloc_peak_bytes"] for run in runs],
        "alloc_peak_seen_frees_bytes_all_steps": [run["alloc_peak_seen_frees_bytes"] for run in runs],
    }


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
