"""Sequence-aware activation checkpointing (SAC) against sequence parallelism without it, 2 CPU ranks.

    python -m benchmarks.sac

(from the repository root) starts ``torchrun --standalone --nproc_per_node=2 -m benchmarks.sac`` itself;
running that torchrun command directly does the same. Rank 0 writes ``benchmarks/results/sac.json`` (every
raw figure, the command, the machine) and ``benchmarks/results/sac.md`` (a table generated from the JSON;
``--render`` regenerates it from the JSON alone). Options: ``--models gpt llama``, ``--seq-lens 1024 2048
4096``, ``--methods sp sac ds_sac``, ``--compiler inductor`` (the real figures) or ``aot_eager`` (same
passes and partitioning, no code generation: a fast smoke run), ``--repeats``, ``--debug`` (print the
saved activations of every graph by producing op, and what the partitioner recomputes).

Methods, all on the same sequence-parallel graph (``AutoSPBackend`` with the SP pass, sp=2, gloo):

* ``sp``: ``AutoSPBackend(sac=False)``, PyTorch's default min-cut partitioner.
* ``sac``: ``AutoSPBackend(sac=True)``, ``lightning_autosp/compiler/partition/sac.py``.
* ``ds_sac``: ``AutoSPBackend(sac=False)`` compiled while DeepSpeed's SAC is in place: DeepSpeed's
  ``init_autosp`` calls ``register_long_context_checkpointing()``
  (``deepspeed/compile/passes/long_context_checkpointing.py``), which ``exec``s a copy of torch's
  ``solve_min_cut`` with its own ``should_ban_recomputation`` into ``torch._functorch.partitioners``,
  for the whole process. Here it is applied for the first step of that one compiled function only (the
  partitioner runs when the forward compiles) and the original ``solve_min_cut`` is put back after.

Per (model, seq_len, method) and rank, after two warm-up steps:

* saved for backward: bytes of the distinct storages of the tensors packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward of the compiled step, parameters
  excluded. AOTAutograd's ``CompiledFunction`` saves its activations with ``ctx.save_for_backward``, which
  the hook sees; the script checks that per step (hooked tensors == ``grad_fn.saved_tensors`` of every
  ``CompiledFunctionBackward`` node, and no tensors in ``ctx._tensors_no_vc_check``, which bypass the hook;
  those would be added to the count) and compares with the partitioner's own estimate
  (``AOT_PARTITIONER_DEBUG``'s "Theoretical Per Activation Storage Sizes", kept per graph in the JSON).
* peak: the high-water mark of the bytes the c10 CPU allocator handed out during one step (forward and
  backward, gradients included, set to None before) and still held, from the profiler's allocation
  events (``profile_memory=True``), least of 3 steps (``benchmarks.measure.allocator_peak``); this covers
  the buffers Inductor's generated code allocates in C++. Also the process RSS high-water mark above the
  RSS at the step's start (``/proc/self/clear_refs`` reset, after ``malloc_trim``): coarse.
  ``torch.distributed._tools.mem_tracker.MemTracker`` is not usable here: it is a ``TorchDispatchMode``,
  and Dynamo skips frames while one is active (``convert_frame.py``, ``should_skip_for_dispatch_mode``),
  so under it the step runs eagerly, without the SP pass, and keeps doing so afterwards until
  ``torch._dynamo.reset()``; the JSON records that check (``memtracker_check``).
* step time: forward + backward, median over ``--repeats`` steps with the methods alternating (order rotated
  every repeat), ranks started together by a barrier; also the median of the per-repeat ratios to the
  ``sp`` step of the same repeat, which holds up better when other work loads the machine.
* parity: loss and gradients of one step against ``sp`` (max over parameters of max|a-b| / max|b|), and
  the rank-averaged gradients against one eager single-process step on the whole sequence.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    MiB,
    current_grads,
    disable_compile_caches,
    grad_rel_err,
    launch_or_work,
    op_of,
    partitioner_log,
    rel_err,
    summarize_partition,
    worker_argv,
)
from benchmarks.measure import allocator_peak, memtracker_check, rss_peak, saved_for_backward
from benchmarks.sac_report import assemble, render_markdown, write_report
from lightning_autosp.extras import require

METHODS = ("sp", "sac", "ds_sac")
MODELS = ("gpt", "llama")
VOCAB = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, all in one sp group")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=RESULTS / "sac.json")
    parser.add_argument("--debug", action="store_true", help="print saved activations per graph by op")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = parser.parse_args(argv)
    if "sp" not in args.methods:
        args.methods.insert(0, "sp")  # the reference of every ratio and parity figure
    return args


# --------------------------------------------------------------------------------------------------
# models


def build_model(name: str, max_len: int) -> tuple[Any, Callable[[dict], Any], dict]:
    """The model, its loss step (batch -> scalar loss) and a description for the JSON."""
    import torch
    import torch.nn.functional as F

    from examples.models import LlamaModule, TinyGPT

    torch.manual_seed(0)
    if name == "gpt":
        config = dict(vocab_size=VOCAB, block_size=max_len, n_layer=2, n_head=8, n_embd=128)
        model = TinyGPT(**config)

        def loss_step(batch: dict) -> Any:
            ids = batch["input_ids"]
            logits = model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        return model, loss_step, {"class": "examples.models.TinyGPT", **config}
    config = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    model = LlamaModule(**config).model  # a transformers LlamaForCausalLM, attn_implementation="sdpa"

    def loss_step(batch: dict) -> Any:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    return model, loss_step, {"class": "transformers.LlamaForCausalLM", **config}


# --------------------------------------------------------------------------------------------------
# DeepSpeed's SAC


def deepspeed_status() -> dict:
    """Whether DeepSpeed's SAC splice applies to this torch; the reason when it does not."""
    try:
        require("deepspeed", extra="bench", needed_by="DeepSpeed's SAC (benchmarks.sac)")
        import deepspeed
        import torch._functorch.partitioners as partitioners
        from deepspeed.compile.passes import long_context_checkpointing as lcc
    except Exception as error:  # any import failure means: not measurable here, and why
        return {"available": False, "reason": f"import failed: {type(error).__name__}: {error}"}
    status = {"deepspeed": deepspeed.__version__, "source": lcc.__file__}
    original = partitioners.solve_min_cut
    try:
        lcc.register_long_context_checkpointing()
        replaced = partitioners.solve_min_cut is not original
    except Exception as error:
        return {**status, "available": False, "reason": f"splice failed: {type(error).__name__}: {error}"}
    finally:
        partitioners.solve_min_cut = original
    if not replaced:
        reason = "register_long_context_checkpointing() left solve_min_cut as it was"
        return {**status, "available": False, "reason": reason}
    return {**status, "available": True}


@contextlib.contextmanager
def deepspeed_sac() -> Iterator[None]:
    """DeepSpeed's ``solve_min_cut`` (sequence-aware ``should_ban_recomputation``) for one compile."""
    import torch._functorch.partitioners as partitioners

    require("deepspeed", extra="bench", needed_by="DeepSpeed's SAC (benchmarks.sac)")
    from deepspeed.compile.passes.long_context_checkpointing import register_long_context_checkpointing

    original = partitioners.solve_min_cut
    register_long_context_checkpointing()
    try:
        yield
    finally:
        partitioners.solve_min_cut = original


# --------------------------------------------------------------------------------------------------
# measurements (every rank runs the same calls in the same order: the steps talk to each other)


def train_step(fn: Callable, batch: dict, model: Any) -> Any:
    model.zero_grad(set_to_none=True)
    loss = fn(batch)
    loss.backward()
    return loss


# --------------------------------------------------------------------------------------------------
# worker


def run_config(args, model, loss_step, seq_len: int, methods: list[str], checks: dict) -> dict:
    """Every measurement of one (model, seq_len) on this rank, per method."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from lightning_autosp.compiler.backend import AutoSPBackend
    from lightning_autosp.compiler.sp_pass import SPContext
    from lightning_autosp.data import shard_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, VOCAB, (args.batch_size, seq_len), generator=generator)
    batch, shard = shard_batch({"input_ids": ids}, world=world, rank=rank)
    context = SPContext(shard, dist.group.WORLD.group_name)

    torch._dynamo.reset()
    out: dict[str, dict] = {}
    fns, backends = {}, {}
    for method in methods:
        backend = AutoSPBackend(context, compiler=args.compiler, sac=method == "sac")
        backend.mark_sharded(batch["input_ids"])
        fn = torch.compile(loss_step, backend=backend, dynamic=False)
        swap = deepspeed_sac() if method == "ds_sac" else contextlib.nullcontext()
        start = time.perf_counter()
        with partitioner_log() as log, swap:
            train_step(fn, batch, model)
        compile_s = time.perf_counter() - start
        fns[method], backends[method] = fn, backend
        out[method] = {
            "compile_s": compile_s,
            "graphs": len(backend.reports),
            "attention": backend.attention_count,
            "all_to_alls": sum(report.all_to_alls for report in backend.reports),
            "partitions": [summarize_partition(graph) for graph in log.graphs],
            "sp_pass": [line for report in backend.reports for line in report.lines()],
        }
    graphs_compiled = counters["stats"]["unique_graphs"]
    for method in methods:  # a second warm-up step
        train_step(fns[method], batch, model)

    # parity: one step each, against sp and against eager on the whole sequence
    grads, losses = {}, {}
    for method in methods:
        losses[method] = train_step(fns[method], batch, model).detach()
        grads[method] = current_grads(model)
    eager_loss = train_step(loss_step, {"input_ids": ids}, model).detach()
    eager_grads = current_grads(model)
    for method in methods:
        averaged = {}
        for name, grad in grads[method].items():
            averaged[name] = grad.clone()
            dist.all_reduce(averaged[name])
            averaged[name] /= world
        out[method].update(
            loss=losses[method].item(),
            loss_rel_err_vs_sp=rel_err(losses[method], losses["sp"]),
            grad_rel_err_vs_sp=grad_rel_err(grads[method], grads["sp"]),
            loss_rel_err_vs_eager=rel_err(losses[method], eager_loss),
            grad_rel_err_vs_eager=grad_rel_err(averaged, eager_grads),
        )

    for method in methods:
        out[method].update(saved_for_backward(lambda fn=fns[method]: fn(batch), model))
    for method in methods:
        out[method].update(allocator_peak(lambda fn=fns[method]: fn(batch), model))
    for method in methods:
        out[method].update(rss_peak(lambda fn=fns[method]: train_step(fn, batch, model), model))

    times: dict[str, list[float]] = {method: [] for method in methods}
    for repeat in range(args.repeats):
        for method in methods[repeat % len(methods) :] + methods[: repeat % len(methods)]:
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            fns[method](batch).backward()
            times[method].append(time.perf_counter() - start)
    for method in methods:
        out[method].update(
            step_times_s=times[method],
            median_step_s=statistics.median(times[method]),
            min_step_s=min(times[method]),
            # per repeat, against the sp step of the same repeat: robust to the machine's load drifting
            paired_time_ratio_vs_sp=statistics.median(t / ref for t, ref in zip(times[method], times["sp"])),
        )

    recompiled = counters["stats"]["unique_graphs"] - graphs_compiled
    for method in methods:
        out[method]["recompiled_during_measurement"] = bool(recompiled) or (
            len(backends[method].reports) != out[method]["graphs"]
        )
    if "memtracker" not in checks:  # last: it leaves the step's code running eagerly until a Dynamo reset
        checks["memtracker"] = memtracker_check(lambda: fns["sp"](batch))
    model.zero_grad(set_to_none=True)
    return out


def worker(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    import torch
    import torch.distributed as dist

    disable_compile_caches()  # else ds_sac would get sp's cached partition
    torch._inductor.config.compile_threads = 1  # no compile worker pool competing with the ranks
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank()
    say = print if rank == 0 else lambda *a, **k: None

    methods = list(args.methods)
    deepspeed = deepspeed_status() if "ds_sac" in methods else {"available": False, "reason": "not requested"}
    if "ds_sac" in methods and not deepspeed["available"]:
        methods.remove("ds_sac")
        say(f"ds_sac skipped: {deepspeed['reason']}", flush=True)

    checks: dict = {}
    per_rank: list[dict] = []
    models: dict[str, dict] = {}
    for model_name in args.models:
        model, loss_step, description = build_model(model_name, max(args.seq_lens))
        models[model_name] = description
        for seq_len in args.seq_lens:
            figures = run_config(args, model, loss_step, seq_len, methods, checks)
            per_rank.append({"model": model_name, "seq_len": seq_len, "methods": figures})
            say(
                f"[{time.perf_counter() - start:6.0f} s] {model_name} seq {seq_len}: "
                + ", ".join(
                    f"{m} {f['saved_bytes'] / MiB:.2f} MiB {f['median_step_s'] * 1e3:.0f} ms"
                    for m, f in figures.items()
                ),
                flush=True,
            )
            if args.debug and rank == 0:
                print_debug(model_name, seq_len, figures)

    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    mine = {"rank": rank, "threads": torch.get_num_threads(), "configs": per_rank}
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        report = assemble(args, gathered, methods, models, deepspeed, checks, time.perf_counter() - start)
        report["machine"]["loadavg_at_start"] = load_at_start
        write_report(report, args.out)
        print(render_markdown(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def print_debug(model_name: str, seq_len: int, figures: dict) -> None:
    for method, fig in figures.items():
        for index, part in enumerate(fig["partitions"]):
            print(
                f"  {model_name} {seq_len} {method} graph {index}: partitioner saves "
                f"{part['estimated_saved_bytes'] / MiB:.2f} MiB in {part['saved_values']} values "
                f"(+{part['saved_primals']} primals); hook saw {fig['saved_bytes'] / MiB:.2f} MiB; "
                f"remat/fw/bw {part['remat_fw_bw']}"
            )
            for op, size in part["saved_bytes_by_op"].items():
                names = [name for _, name in part["saved"] if op_of(name) == op]
                print(f"    {size / MiB:8.3f} MiB  {op:<48} {' '.join(names)}")
            if part["rematerialized_ops"]:
                print(f"    recomputed in backward: {part['rematerialized_ops']}")


def main(argv: list[str] | None = None) -> int:
    argv = worker_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        write_report(json.loads(args.out.read_text()), args.out)
        print(args.out.with_suffix(".md").read_text())
        return 0
    return launch_or_work("benchmarks.sac", argv, args, write_report=write_report, work=worker)


if __name__ == "__main__":
    sys.exit(main())
