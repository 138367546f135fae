"""What is live at one rank's memory peak during a compiled training step, by kind and by op.

    python -m benchmarks.peak_breakdown                 # 8-layer GPT and Llama, sp=2 on 2 CPU ranks, fp32
    python -m benchmarks.peak_breakdown --models llama-tiny --seq-len 8192 --methods sac ulysses

From the repository root the command starts ``torchrun`` itself. Rank 0 writes
``benchmarks/results/peak_breakdown.json`` and ``.md`` (``--render`` rewrites the .md from the JSON).
Models and methods are those of ``benchmarks.run`` (``benchmarks/models.py``, ``benchmarks/methods.py``).

Measured, per (model, method), on the step with the lowest peak of ``--steps`` profiled steps (after
two warm-up steps; gradients set to None before each): the CPU allocator's high-water mark
(``benchmarks.measure.replay``) and every block still allocated at that instant, each attributed by
identity and by the op that allocated it (the profiler's event tree):

* ``gradients``: storages of ``param.grad`` after the step;
* ``saved for backward``: storages the forward packed for backward (``saved_tensors_hooks``); of those,
  the outputs of collectives (the all-to-all'd q, k, v) are also counted in ``saved: collective outputs``;
* ``collective buffers``: other blocks allocated inside a collective (its receive buffer);
* ``forward in flight``: blocks the forward allocated that are neither saved nor gradients (the loss,
  values still in use when the peak is in forward);
* ``backward temporaries``: blocks backward allocated that are neither gradients nor collective
  buffers: the block being rebuilt, activation gradients and kernel workspace (split by ``static``).

The high-water mark holds a block whose free the profiler did not record until its address is allocated
again: gloo's worker thread can drop the last reference to an all-to-all's buffers, and the profiler
records the threads it runs on. So every step's peak is also given without those blocks (a lower bound;
``benchmarks.measure.unseen_frees``), and the step with the lowest peak is the one broken down.

``static`` (this project's methods only) walks the partitioned backward graph in order, sizes from its
fake values, views sharing their base's bytes, each value freed after its last use, the step's inputs
(parameters, the batch) left out, and reports the values live where that sum is highest, as: saved
activations still needed, the block being rebuilt (forward ops backward recomputes), collective
buffers (collective outputs and the values they send), parameter gradients, and activation
gradients and workspace. Inductor fuses elementwise chains, so fewer of those values exist in the
generated code: an upper bound that says what the block holds.

DDP buckets: none in these steps (``benchmarks.methods`` all-reduces every gradient in place after
backward); under Lightning's DDP they would add one copy of the gradients to every method alike
(``parameter_bytes``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    MiB,
    disable_compile_caches,
    render_or_launch,
    report_header,
    write_report,
)
from benchmarks.measure import (
    BACKWARD_MARK,
    Allocation,
    allocation_peak,
    gradient_storages,
    replay,
    step_events,
)

KINDS = (
    "saved for backward",
    "collective buffers",
    "backward temporaries",
    "gradients",
    "forward in flight",
)
STATIC_KINDS = (
    "saved activations",
    "block being rebuilt",
    "collective buffers",
    "parameter gradients",
    "activation gradients and workspace",
)
_COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d_functional::", "c10d::", "autosp::", "gloo:", "nccl:")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-tiny", "llama-tiny"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["sac", "sp", "ulysses"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps; the lowest peak is reported")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "peak_breakdown.json")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# measured: the blocks live at the allocator's peak


def _op_path(event: Any) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.parent
    return names


def _allocating_op(path: list[str]) -> str:
    """The innermost op that is not a bare allocation; Inductor's own buffers are named by their graph."""
    for name in path[1:]:
        if name.startswith("## Call CompiledFxGraph"):
            return "Inductor buffer"
        if name not in ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"):
            return name
    return path[-1] if path else "?"


def live_at_peak(prof: Any) -> tuple[int, int, list[dict], int | None, list[Allocation]]:
    """(peak bytes, time of the peak, the blocks live then, start of backward, every CPU allocator event) of
    a finished profile; allocations and frees are matched by address (``benchmarks.measure.replay``)."""
    events, backward_start, _ = step_events(prof)
    peak = peak_time = 0
    snapshot: list[Allocation] = []
    for (when, _, _), _, held, live in replay(events):
        if held > peak:
            peak, peak_time, snapshot = held, when, list(live.values())
    blocks = []
    for allocation in snapshot:
        path = _op_path(events[allocation])
        blocks.append(
            {
                "ptr": allocation[2],
                "bytes": allocation[1],
                "time": allocation[0],
                "op": _allocating_op(path),
                "collective": any(name.startswith(_COLLECTIVE_PREFIXES) for name in path),
            }
        )
    return peak, peak_time, blocks, backward_start, list(events)


def attribute(blocks: list[dict], saved: set[int], grads: set[int], backward_start: int | None) -> dict:
    """Bytes per kind (``KINDS``) of the blocks live at the peak, and per allocating op."""
    kinds: Counter = Counter({kind: 0 for kind in KINDS})
    ops: Counter = Counter()
    saved_collective = 0
    for block in blocks:
        in_backward = backward_start is not None and block["time"] >= backward_start
        if block["ptr"] in grads:
            kind = "gradients"
        elif block["ptr"] in saved:
            kind = "saved for backward"
            saved_collective += block["bytes"] if block["collective"] else 0
        elif block["collective"]:
            kind = "collective buffers"
        elif in_backward:
            kind = "backward temporaries"
        else:
            kind = "forward in flight"
        kinds[kind] += block["bytes"]
        ops[f"{'bw' if in_backward else 'fw'} {block['op']}"] += block["bytes"]
    return {
        "by_kind": dict(kinds),
        "saved_collective_outputs": saved_collective,
        "by_op": dict(ops.most_common(12)),
    }


def measure(forward: Callable[[], Any], backward: Callable[[Any], None], model: Any) -> dict:
    """One profiled step: the peak, what is live there by kind and op, and when it happens."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    model.zero_grad(set_to_none=True)
    gc.collect()
    packed: list = []

    def pack(tensor: Any) -> Any:
        packed.append(tensor)
        return tensor

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = forward()
        saved = {t.untyped_storage().data_ptr() for t in packed}
        packed.clear()
        with record_function(BACKWARD_MARK):
            backward(loss)
    grads = gradient_storages(model)
    peak, peak_time, blocks, backward_start, allocations = live_at_peak(prof)
    figures = attribute(blocks, saved, grads, backward_start)
    phase = "backward" if backward_start is not None and peak_time >= backward_start else "forward"
    return {
        "peak_bytes": peak,
        "peak_seen_frees_bytes": allocation_peak(allocations, kept=grads),
        "phase": phase,
        "blocks_live": len(blocks),
        **figures,
    }


# --------------------------------------------------------------------------------------------------
# static: the partitioned backward graph, walked in order


def _is_view(node: Any) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _nbytes(node: Any) -> int:
    import torch

    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return int(value.untyped_storage().nbytes()) if not _is_view(node) else 0
    return 0  # a tuple of outputs: each is counted at its getitem


def backward_liveness(backward: Any) -> dict:
    """The values of the partitioned backward graph live where their bytes sum highest, by kind."""
    from lightning_autosp.compiler.runtime.ops import is_collective

    nodes = list(backward.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    base: dict[Any, Any] = {}
    for node in nodes:  # a view keeps its base alive
        inputs = node.all_input_nodes
        base[node] = base[inputs[0]] if _is_view(node) and inputs else node
    last_use: dict[Any, int] = {}
    output = nodes[-1]
    for node in nodes:
        for source in node.all_input_nodes:
            root = base[source]
            last_use[root] = max(last_use.get(root, 0), len(nodes) if node is output else index[node])
    from_tangents = set()
    for node in nodes:
        if (node.op == "placeholder" and "tangents" in node.name) or any(
            n in from_tangents for n in node.all_input_nodes
        ):
            from_tangents.add(node)
    sends = {
        n for node in nodes if is_collective(node) for n in node.all_input_nodes if n.op != "placeholder"
    }
    gradients = {base[n] for n in output.all_input_nodes}

    def kind(node: Any) -> str:
        if node.op == "placeholder":
            return "activation gradients and workspace" if node in from_tangents else "saved activations"
        if is_collective(node) or node in sends:
            return "collective buffers"
        if node in gradients:
            return "parameter gradients"
        if node not in from_tangents:
            return "block being rebuilt"
        return "activation gradients and workspace"

    live: dict[Any, int] = {}
    peak, at, snapshot = 0, 0, {}
    for i, node in enumerate(nodes):
        # The step's inputs (parameters, the batch) are held before the step: not in its peak.
        if node.op != "output" and base[node] is node and not node.name.startswith("primals"):
            live[node] = _nbytes(node)
        total = sum(live.values())
        if total > peak:
            peak, at, snapshot = total, i, dict(live)
        for done in [n for n in live if last_use.get(n, -1) <= i]:
            del live[done]
    kinds: Counter = Counter({k: 0 for k in STATIC_KINDS})
    ops: Counter = Counter()
    for node, nbytes in snapshot.items():
        kinds[kind(node)] += nbytes
        ops[f"{kind(node)}: {_op(node)}"] += nbytes
    return {
        "peak_bytes": peak,
        "at_node": f"{at}/{len(nodes)} {nodes[at].name}",
        "by_kind": dict(kinds),
        "by_op": dict(ops.most_common(10)),
    }


def _op(node: Any) -> str:
    import re

    if node.op == "placeholder":
        return re.sub(r"_\d+$", "", node.name)
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "__name__", str(node.target))


def recording_partitioner(mode: str) -> Any:
    """The SAC partitioner, keeping the static breakdown of every backward graph it makes."""
    from lightning_autosp.compiler.partition.sac import SequenceAwarePartitioner

    class Recording(SequenceAwarePartitioner):
        def __init__(self) -> None:
            super().__init__(mode)
            self.static: list[dict] = []

        def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            forward, backward = super().__call__(gm, joint_inputs, **kwargs)
            self.static.append(backward_liveness(backward))
            return forward, backward

    return Recording()


# --------------------------------------------------------------------------------------------------
# worker


def worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.methods import METHODS, Ours, RunContext
    from benchmarks.models import build, preset

    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    torch.set_num_threads(args.threads)
    disable_compile_caches()
    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.recompile_limit = 64
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = RunContext(
        rank, world, dist.group.WORLD, torch.device("cpu"), args.compiler, getattr(torch, args.dtype)
    )
    start = time.monotonic()
    results: dict[str, dict] = {}
    for model_name in args.models:
        spec = preset(model_name, args.layers)
        with torch.device("meta"):
            parameter_bytes = sum(p.numel() * ctx.dtype.itemsize for p in build(spec).parameters())
        results[model_name] = {"parameter_bytes": parameter_bytes}
        for name in args.methods:
            method = METHODS[name](spec, ctx)
            generator = torch.Generator().manual_seed(args.seq_len)
            ids = torch.randint(0, spec.vocab_size, (1, args.seq_len), generator=generator)
            prepared = method.prepare(ids)
            if isinstance(method, Ours):
                method.backends[-1].partitioner = recording_partitioner(method.backends[-1].partitioner.mode)
            for _ in range(2):
                method.model.zero_grad(set_to_none=True)
                prepared.step()
            runs = [measure(prepared.forward, prepared.backward, method.model) for _ in range(args.steps)]
            figures = min(runs, key=lambda run: run["peak_bytes"])
            figures["peak_bytes_all_steps"] = [run["peak_bytes"] for run in runs]
            figures["peak_seen_frees_all_steps"] = [run["peak_seen_frees_bytes"] for run in runs]
            if isinstance(method, Ours):
                figures["static"] = method.backends[-1].partitioner.static
            results[model_name][name] = figures
            if rank == 0:
                print(
                    f"[{time.monotonic() - start:5.0f} s] {model_name} {name}: "
                    f"{figures['peak_bytes'] / MiB:.1f} MiB ({figures['phase']})",
                    flush=True,
                )
            del method, prepared
            gc.collect()
            torch._dynamo.reset()
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        report = {**report_header("benchmarks.peak_breakdown", args, start), "per_rank": gathered}
        write_outputs(report, args.out)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# report

_LABELS = {
    "sac": "ours: SP + SAC",
    "longest": "ours: SP + SAC, longest",
    "sp": "ours: SP",
    "alst": "ALST-style",
    "ulysses": "hand-written Ulysses",
    "ddp": "DDP",
}


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        "# What is live at the memory peak of one step",
        "",
        f"`{report['command']}`; {settings['nproc']} ranks (gloo, CPU), sp={settings['nproc']}, "
        f"{settings['layers']} layers, {settings['seq_len']} tokens, batch 1, {settings['dtype']}, "
        f"`{settings['compiler']}`; code {report['code']['commit'][:10]}"
        f"{' (uncommitted changes)' if report['code']['lightning_autosp_uncommitted_changes'] else ''}.",
        "Per rank, the rank with the highest peak; MiB at the CPU allocator's high-water mark of the step "
        "(what the step allocated and still held; parameters and what was allocated before are not in it).",
        "",
        "| model | method | peak | phase | " + " | ".join(KINDS) + " | of saved: collective outputs |",
        "|---|---|---:|---|" + "---:|" * (len(KINDS) + 1),
    ]
    ranks = report["per_rank"]
    for model in ranks[0]:
        for method in [m for m in ranks[0][model] if m != "parameter_bytes"]:
            r = max((per_rank[model][method] for per_rank in ranks), key=lambda f: f["peak_bytes"])
            kinds = " | ".join(_mib(r["by_kind"][k]) for k in KINDS)
            lines.append(
                f"| {model} | {_LABELS.get(method, method)} | {_mib(r['peak_bytes'])} | {r['phase']} | "
                f"{kinds} | {_mib(r['saved_collective_outputs'])} |"
            )
    lines += [
        "",
        "Largest allocating ops live at the peak (MiB; `bw` / `fw`: allocated in backward / forward):",
        "",
    ]
    for model in ranks[0]:
        for method in [m for m in ranks[0][model] if m != "parameter_bytes"]:
            r = max((per_rank[model][method] for per_rank in ranks), key=lambda f: f["peak_bytes"])
            ops = ", ".join(f"{op} {_mib(n)}" for op, n in list(r["by_op"].items())[:8])
            lines.append(f"- {model}, {_LABELS.get(method, method)}: {ops}")
    steps = [
        (model, method)
        for model in ranks[0]
        for method in ranks[0][model]
        if method != "parameter_bytes" and "peak_seen_frees_all_steps" in ranks[0][model][method]
    ]
    if steps:
        lines += [
            "",
            "Every profiled step's peak per rank, as measured / leaving out the blocks whose free no event "
            "shows (freed on a thread the profiler does not record; `benchmarks.measure.unseen_frees`), MiB:",
            "",
        ]
    for model, method in steps:
        per_rank = "; ".join(
            f"rank {rank}: "
            + ", ".join(
                f"{_mib(measured)} / {_mib(seen)}"
                for measured, seen in zip(
                    ranks[rank][model][method]["peak_bytes_all_steps"],
                    ranks[rank][model][method]["peak_seen_frees_all_steps"],
                )
            )
            for rank in range(len(ranks))
        )
        lines.append(f"- {model}, {_LABELS.get(method, method)}: {per_rank}")
    lines += [
        "",
        "Static walk of the partitioned backward graph (this project's methods; values live at its "
        "highest point, before Inductor's fusion: an upper bound):",
        "",
        "| model | method | static peak | " + " | ".join(STATIC_KINDS) + " | where |",
        "|---|---|---:|" + "---:|" * len(STATIC_KINDS) + "---|",
    ]
    for model in ranks[0]:
        for method in [m for m in ranks[0][model] if m != "parameter_bytes"]:
            r = max((per_rank[model][method] for per_rank in ranks), key=lambda f: f["peak_bytes"])
            for graph in r.get("static", []):
                kinds = " | ".join(_mib(graph["by_kind"][k]) for k in STATIC_KINDS)
                lines.append(
                    f"| {model} | {_LABELS.get(method, method)} | {_mib(graph['peak_bytes'])} | {kinds} | "
                    f"{graph['at_node']} |"
                )
    lines += [""]
    for model in ranks[0]:
        lines.append(
            f"DDP buckets ({model}): none in these steps (gradients all-reduced in place after backward); "
            f"Lightning's DDP would add {_mib(ranks[0][model]['parameter_bytes'])} MiB (one copy of the "
            "gradients) to every method alike."
        )
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    write_report(report, out, render_markdown)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return render_or_launch("benchmarks.peak_breakdown", argv, parse_args, write_outputs, worker_main)


if __name__ == "__main__":
    sys.exit(main())
