"""The paper's headline at real sizes on one GPU: SAC's trainable length against hand-written Ulysses'.

    python -m benchmarks.headline                                   # one GPU: sp=1, and rank 0 of sp=8
    python -m benchmarks.headline --device cpu --model llama-smoke --layers 2 --sp 1 2 \\
        --probe-lens 256 512 --budget-mib 64 --compiler aot_eager   # the same code path on a CPU, tiny

One GPU cannot run 8 ranks. What one rank of an 8-rank run holds can still be measured on it: torch's
fake process group stands in for the other ranks (``init_process_group("fake")``: collectives return at
once and move no data, and every receive buffer has its real size), so rank 0 compiles and runs the very
graph it would in an 8-rank run and its allocator peak is that rank's. Values are not: no parity or
time is reported from a stood-in run.

Per sp size P (``--sp``, default 1 and 8) and method (``--methods``, default ``sac`` and ``ulysses`` of
``benchmarks.methods``), one step at each of two lengths (``--probe-lens`` per rank, times P), from which

* measured: the allocator peak above what was allocated before the step (parameters);
* the line through the two peaks, and where it crosses the memory left on the device (CUDA: 90% of
  what is free; CPU: ``--budget-mib``): the longest trainable length, extrapolated. At these lengths
  every term of a step's peak grows linearly with the sequence (flash attention's workspace included),
  so two points fix the line; a method whose peak grows faster shows it as a line fitted too low, which
  is why the second probe should be the longer one the time box allows;
* modelled: ``lightning_autosp.planning.memory_model`` (the planner's) at the same lengths, and its
  longest length for the device, beside the measured line (``sac`` as SP + SAC with the chunked loss;
  ``ulysses`` as no SAC, full fp32 logits, like HF's loss).

Output: ``benchmarks/results/headline.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.common import RESULTS, MiB, disable_compile_caches, report_header, write_report
from benchmarks.measure import allocator_peak, cuda_peak

GiB = 2**30
_LABELS = {
    "sac": "ours: SP + SAC",
    "sp": "ours: SP",
    "ulysses": "hand-written Ulysses",
    "longest": 'ours: sac="longest"',
    "longest_offload": 'ours: sac="longest", offload_activations',
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", help="a preset of benchmarks/models.py")
    parser.add_argument("--layers", type=int, default=4, help="cut the model to this many layers")
    parser.add_argument("--methods", nargs="+", default=["sac", "ulysses"], help="of: sac sp ulysses")
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 8], help="sp sizes; rank 0 of each")
    parser.add_argument("--probe-lens", nargs=2, type=int, default=[4096, 8192], help="tokens per rank")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-mib", type=float, help="memory a step may use (default: 90%% of free CUDA)")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no new probe after this")
    parser.add_argument("--out", type=Path, default=RESULTS / "headline.json")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    return parser.parse_args(argv)


def stand_in_for(world: int) -> Any:
    """Make this process rank 0 of ``world`` ranks whose collectives move nothing; the group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return dist.group.WORLD


@contextlib.contextmanager
def receiving_without_sending() -> Iterator[None]:
    """Torch's fake group fills what a rank receives in an all-to-all by repeating what it sends, so it
    raises where a rank sends nothing but receives rows: rank 0 in a label shift's window of the sequence
    (it takes the next rank's first label and gives none). There the stand-in rank receives zeros of the
    size it would receive (a few rows; memory is measured, not values)."""
    from lightning_autosp.compiler.runtime import ops

    all_to_all = ops._all_to_all

    def stand_in(rows: Any, output_splits: list[int], input_splits: list[int], group_name: str) -> Any:
        if sum(input_splits) == 0:
            return rows.new_zeros((sum(output_splits), *rows.shape[1:]))
        return all_to_all(rows, output_splits, input_splits, group_name)

    with mock.patch.object(ops, "_all_to_all", stand_in):
        yield


def crossing(points: dict[int, float], budget: float) -> int | None:
    """Where the line through two (length, bytes) points reaches ``budget``; None if it does not grow."""
    (a, pa), (b, pb) = sorted(points.items())
    slope = (pb - pa) / (b - a)
    return int(a + (budget - pa) / slope) if slope > 0 else None


def modelled(method: str, model: Any, sp: int, dtype: str, seq_lens: list[int], budget: float) -> dict:
    """The memory model's bytes above the parameters at ``seq_lens``, and its longest length in ``budget``."""
    from lightning_autosp.planning.memory_model import Setup, step_memory
    from lightning_autosp.planning.model_shapes import model_shape
    from lightning_autosp.planning.planner import max_seq_len

    shape = model_shape(model)
    setup = Setup(
        sp_size=sp,
        devices=sp,
        sac=method in ("sac", "longest", "longest_offload"),
        rebuild_attention=method.startswith("longest"),
        offload_activations=method == "longest_offload",
        precision="bf16-true" if dtype == "bfloat16" else "32-true",
        chunked_loss=method != "ulysses",
        optimizer_states=0,
        optimizer_impl="fused",
    )

    # Held whatever the length, and not in the measured peak: the parameters, and the DDP buckets the
    # model counts (the benchmark all-reduces gradients in place). Without optimizer state the step's
    # peak is forward and backward's (Note [Step peak]), so the planner's search applies with them added.
    held = step_memory(shape, setup, sp).params + shape.param_count * setup.param_bytes

    def above_params(seq_len: int) -> int:
        return step_memory(shape, setup, seq_len).total - held

    return {
        "bytes": {str(s): above_params(s) for s in seq_lens},
        "max_len": max_seq_len(shape, setup, int(budget) + held),
    }


def run(args: argparse.Namespace) -> dict:
    with receiving_without_sending():
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.methods import METHODS, RunContext
    from benchmarks.models import preset

    disable_compile_caches()
    torch._dynamo.config.recompile_limit = 64
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    spec = preset(args.model, args.layers)
    start = time.monotonic()
    rows: list[dict] = []
    for sp in args.sp:
        group = stand_in_for(sp)
        ctx = RunContext(0, sp, group, device, args.compiler, getattr(torch, args.dtype))
        for name in args.methods:
            row: dict[str, Any] = {"sp": sp, "method": name, "peaks": {}}
            rows.append(row)
            try:
                method = METHODS[name](spec, ctx)
                for per_rank in args.probe_lens:
                    if args.deadline_s and time.monotonic() - start > args.deadline_s:
                        row["skipped"] = "deadline"
                        break
                    seq_len = per_rank * sp
                    ids = torch.randint(0, spec.vocab_size, (1, seq_len), device=device)
                    prepared = method.prepare(ids)
                    prepared.step()  # compile
                    method.model.zero_grad(set_to_none=True)
                    if cuda:
                        peak = cuda_peak(prepared.forward, method.model, prepared.backward)
                    else:
                        peak = allocator_peak(prepared.forward, method.model, prepared.backward, steps=1)
                    row["peaks"][str(seq_len)] = peak["alloc_peak_bytes"]
                    del prepared
                    method.model.zero_grad(set_to_none=True)
                    print(
                        f"[{time.monotonic() - start:5.0f} s] sp={sp} {name} {seq_len}: "
                        f"{peak['alloc_peak_bytes'] / MiB:.0f} MiB",
                        flush=True,
                    )
                if cuda:
                    free, _ = torch.cuda.mem_get_info()
                    budget = args.budget_mib * MiB if args.budget_mib else 0.9 * free
                else:
                    budget = args.budget_mib * MiB
                row["budget_bytes"] = budget
                lens = [per_rank * sp for per_rank in args.probe_lens]
                row["model"] = modelled(name, method.model, sp, args.dtype, lens, budget)
                if len(row["peaks"]) == 2:
                    row["max_len"] = crossing({int(s): b for s, b in row["peaks"].items()}, budget)
            except Exception as exc:  # out of memory at a probe, a refusal: recorded, the rest goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            finally:
                method = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
    return {**report_header("benchmarks.headline", args, start), "rows": rows}


def _length(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"# Trainable length at {settings['model']} shapes "
        f"({settings['layers']} layers, {settings['dtype']}, {settings['device']})",
        "",
        f"`{report['command']}`; code {report['code']['commit'][:10] if report['code']['commit'] else '?'}, "
        f"{report['wall_s_worker']} s. Rank 0 of each sp size measured in one process (the other ranks "
        "stood in by torch's fake process group); longest length where the line through the two measured "
        "peaks meets the memory left on the device; the memory model's beside it.",
        "",
        "| sp | method | peak at probes (MiB) | longest, measured line | longest, memory model "
        "| model error at probes |",
        "|---:|---|---|---:|---:|---|",
    ]
    by_key = {(row["sp"], row["method"]): row for row in report["rows"]}
    for row in report["rows"]:
        peaks = ", ".join(f"{int(s):,}: {b / MiB:.0f}" for s, b in row["peaks"].items())
        peaks = peaks or row.get("error", "")
        model = row.get("model", {})
        errors = ", ".join(
            f"{(model['bytes'][s] - b) / b:+.0%}"
            for s, b in row["peaks"].items()
            if s in model.get("bytes", {})
        )
        lines.append(
            f"| {row['sp']} | {_LABELS.get(row['method'], row['method'])} | {peaks} | "
            f"{_length(row.get('max_len'))} | {_length(model.get('max_len'))} | {errors} |"
        )
    lines.append("")
    for sp in settings["sp"]:
        sac, ulysses = by_key.get((sp, "sac")), by_key.get((sp, "ulysses"))
        if sac and ulysses and sac.get("max_len") and ulysses.get("max_len"):
            lines.append(
                f"- sp={sp}: SAC / Ulysses = {sac['max_len'] / ulysses['max_len']:.2f}x measured line, "
                f"{sac['model']['max_len'] / max(ulysses['model']['max_len'], 1):.2f}x memory model "
                "(goal >= 2.7x)."
            )
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    write_report(report, out, render_markdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.render:
        write_outputs(json.loads(args.out.read_text()), args.out)
    else:
        if args.device == "cpu" and not args.budget_mib:
            raise SystemExit("--device cpu needs --budget-mib (the memory a step may use)")
        write_outputs(run(args), args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
