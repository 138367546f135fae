"""Side by side: this project, DeepSpeed's AutoSP, hand-written Ulysses, DDP and ring attention.

    python -m benchmarks.run --suite cpu      # 2 CPU ranks, gloo, Inductor, tiny GPT + tiny Llama (~10 min)
    python -m benchmarks.run --suite smoke    # every method, one tiny step (aot_eager), for the tests
    bash benchmarks/gpu_check.sh              # --suite gpu on the GPUs of one machine (<= 8 min)

From the repository root, the command starts ``torchrun`` itself (``--nproc`` ranks, all in one sp
group). Rank 0 writes ``benchmarks/results/<suite>.json`` (every raw figure, per rank, with the command and
the machine), and from it ``<suite>.md`` (the table) and ``<suite>.png`` (per-rank peak memory against
sequence length, one line per method); ``python -m benchmarks.report <suite>`` renders them again from
the JSON alone. The methods are described in ``benchmarks/methods.py``, the models in
``benchmarks/models.py``.

What is measured, per model and method (every rank runs the same calls in the same order):

* at every sequence length of ``--seq-lens``: the first step (compiles; static shapes recompile per length,
  DeepSpeed's dynamic-shape graph does not), a steady step, and the peak memory of a step per rank: on
  CPU the high-water mark of the bytes the c10 CPU allocator handed out during the step and still held
  (profiler allocation events, least of ``--profiled-steps`` steps; ``benchmarks/measure.py``), an upper
  bound: a block whose last reference gloo's worker thread drops has no free event and counts until its
  address is allocated again, so each step's lower bound without such blocks is kept beside it
  (``alloc_peak_seen_frees_bytes``; the search below decides on the upper one); on GPU the
  CUDA caching allocator's ``max_memory_allocated`` above the allocation at the step's start; and the
  bytes each rank passes to every collective, split into forward and backward (profiler events
  ``gloo:all_to_all``, ``nccl:all_reduce``, ...).
* at ``--parity-len``: loss and gradients against one eager single-process step on the whole sequence
  (max relative error ``max|a-b| / max|b|``; the loss each rank reports, the gradients after the method's
  synchronisation).
* at ``--headline-len``: the bytes saved for backward per rank (``saved_tensors_hooks``, parameters
  excluded) and the step time: ``--repeats`` rounds, the methods alternating (order rotated every round),
  ranks started together by a barrier; median per method, and the median of the per-round ratios to
  ``ulysses``.
* the longest sequence that trains within a per-rank memory budget (``--budget-mib``): a search on
  measured peaks (interpolating between the longest length under and the shortest over the budget,
  rounded to ``--granularity``, until they are within ``--search-tolerance`` or ``--search-steps`` more
  lengths were measured). ``--search oom`` (one rank only) uses real out-of-memory errors instead.

A method that fails (at build, compile or any step) is recorded with its error and skipped afterwards;
all ranks agree on every such decision before going on. ``--deadline-s`` stops starting new work past
that many seconds (what is done is written).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from benchmarks.common import (
    MiB,
    bench_command,
    code_version,
    disable_compile_caches,
    grad_rel_err,
    launch_or_work,
    machine_info,
    worker_argv,
)
from benchmarks.length_search import is_out_of_memory, next_candidate
from benchmarks.measure import allocator_peak, cuda_peak, profiled_step, saved_for_backward, timed
from benchmarks.paired import paired_ratios
from benchmarks.report import write_outputs
from benchmarks.suites import PAIRED_REFERENCES, parse_launch_args
from benchmarks.summary import assemble


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parse_launch_args(argv, description=__doc__.split("\n\n")[0])


def plan(args: argparse.Namespace) -> dict:
    """The resolved settings, with each model's parameter count (built on the meta device)."""
    import torch

    from benchmarks.models import build, preset

    models = {}
    for name in args.models:
        spec = preset(name, args.layers)
        with torch.device("meta"):
            params = sum(p.numel() for p in build(spec).parameters())
        models[name] = {**spec.describe(), "parameters": params}
    return {"suite": args.suite, "settings": settings_of(args), "models": models}


def settings_of(args: argparse.Namespace) -> dict:
    keys = (
        "nproc methods seq_lens headline_len parity_len repeats profiled_steps budget_mib search granularity "
        "search_steps search_tolerance batch_size compiler dtype autocast device threads deadline_s layers"
    )
    return {key: getattr(args, key) for key in keys.split()}


# --------------------------------------------------------------------------------------------------
# worker


class Worker:
    """One rank's run of the suite."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        from benchmarks.methods import RunContext

        self.args, self.start = args, time.monotonic()
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if self.cuda else "gloo", timeout=timedelta(minutes=30))
        self.dist, self.torch = dist, torch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.ctx = RunContext(
            rank=self.rank,
            world=self.world,
            group=dist.group.WORLD,
            device=device,
            compiler=args.compiler,
            dtype=getattr(torch, args.dtype),
            autocast=None if args.autocast == "none" else getattr(torch, args.autocast),
        )
        torch.set_num_threads(args.threads)
        disable_compile_caches()
        if not self.cuda:
            torch._inductor.config.compile_threads = 1  # no compile worker pool competing with the ranks
        # Static shapes: every (method, length) is its own compiled graph of the same step function.
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024

    # agreement between ranks: every decision that changes which collectives run next goes through these

    def all_ok(self, ok: bool) -> bool:
        flag = self.torch.tensor([int(ok)], device=self.ctx.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MIN)
        return bool(flag.item())

    def max_over_ranks(self, value: float) -> float:
        tensor = self.torch.tensor([float(value)], dtype=self.torch.float64, device=self.ctx.device)
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return tensor.item()

    def past_deadline(self) -> bool:
        late = bool(self.args.deadline_s) and time.monotonic() - self.start > self.args.deadline_s
        return not self.all_ok(not late)

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{time.monotonic() - self.start:6.0f} s] {message}", flush=True)

    # measurements of one prepared step

    def batch(self, spec: Any, seq_len: int) -> Any:
        generator = self.torch.Generator().manual_seed(seq_len)
        ids = self.torch.randint(0, spec.vocab_size, (self.args.batch_size, seq_len), generator=generator)
        return ids.to(self.ctx.device)

    def peak(self, method: Any, prepared: Any, collectives: bool = True) -> dict:
        if self.cuda:
            figures = cuda_peak(prepared.forward, method.model, prepared.backward)
            if collectives:
                method.model.zero_grad(set_to_none=True)
                run = profiled_step(prepared.forward, prepared.backward)
                figures.update(
                    collective_bytes=run["collective_bytes"], collective_calls=run["collective_calls"]
                )
            return figures
        steps = self.args.profiled_steps
        return allocator_peak(prepared.forward, method.model, prepared.backward, steps=steps)

    def step(self, method: Any, prepared: Any) -> float:
        method.model.zero_grad(set_to_none=True)
        return timed(prepared.step, self.cuda)

    def measure_length(self, method: Any, seq_len: int, *, for_search: bool = False) -> tuple[Any, dict]:
        """Prepare ``method`` at ``seq_len``; first step, a steady step and the peak. Raises on failure.

        ``for_search``: the collectives are not recorded; the out-of-memory search runs one step only.
        """
        prepared = method.prepare(self.batch(method.spec, seq_len))
        prepared = prepared.under_autocast(self.ctx.device, self.ctx.autocast)
        if self.cuda and for_search and self.args.search == "oom":
            # Does it fit? One step (compile included) under the CUDA allocator's peak counter is enough.
            start = time.perf_counter()
            figures = cuda_peak(prepared.forward, method.model, prepared.backward)
            method.model.zero_grad(set_to_none=True)
            return prepared, {"first_step_s": time.perf_counter() - start, "steady_step_s": None, **figures}
        first = self.step(method, prepared)
        steady = self.step(method, prepared)
        figures = {
            "first_step_s": first,
            "steady_step_s": steady,
            **self.peak(method, prepared, not for_search),
        }
        method.model.zero_grad(set_to_none=True)
        return prepared, figures

    # the suite

    def run(self) -> dict:
        from benchmarks.models import preset

        results = {}
        for name in self.args.models:
            spec = preset(name, self.args.layers)
            results[name] = self.run_model(name, spec)
            gc.collect()
            self.torch._dynamo.reset()
        return results

    def run_model(self, model_name: str, spec: Any) -> dict:
        from benchmarks.methods import METHODS

        out: dict[str, dict] = {m: {"lengths": {}, "status": "ok"} for m in self.args.methods}
        live: dict[str, Any] = {}
        for name in self.args.methods:
            error = None
            try:
                live[name] = METHODS[name](spec, self.ctx)
                out[name]["label"] = METHODS[name].label
            except Exception as exc:
                error = exc
            self.settle(out[name], name, live, error, stage="build")

        for seq_len in self.args.seq_lens:
            if self.past_deadline():
                self.say(f"{model_name}: deadline reached before length {seq_len}")
                break
            prepared = {}
            for name in list(live):
                if self.past_deadline():
                    out[name]["lengths_skipped"] = [*out[name].get("lengths_skipped", []), seq_len]
                    continue
                error = None
                try:
                    prepared[name], figures = self.measure_length(live[name], seq_len)
                    out[name]["lengths"][str(seq_len)] = figures
                except Exception as exc:
                    error = exc
                self.settle(out[name], name, live, error, stage=f"length {seq_len}")
                prepared = {n: p for n, p in prepared.items() if n in live}
            if seq_len == self.args.parity_len:
                self.parity(spec, seq_len, live, prepared, out)
            if seq_len == self.args.headline_len:
                self.headline(seq_len, live, prepared, out)
            self.say(
                f"{model_name} seq {seq_len}: "
                + ", ".join(
                    f"{n} {out[n]['lengths'][str(seq_len)]['alloc_peak_bytes'] / MiB:.1f} MiB"
                    for n in prepared
                )
            )
        if self.args.search != "none":
            for name in list(live):
                if self.past_deadline():
                    out[name]["search"] = {"skipped": "deadline"}
                    continue
                out[name]["search"] = self.search(live[name], out[name])
                self.say(f"{model_name} {name}: max length {out[name]['search'].get('max_len')}")
        for name, method in live.items():
            out[name]["info"] = {
                **method.info,
                **(method.graph_facts() if hasattr(method, "graph_facts") else {}),
            }
        return out

    def settle(self, record: dict, name: str, live: dict, error: Exception | None, stage: str) -> None:
        """All ranks agree whether ``name`` survived ``stage``; a failed method is recorded and dropped."""
        if self.all_ok(error is None):
            return
        record["status"] = "failed"
        record["failed_at"] = stage
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}".strip()[:4000]
            record["traceback_tail"] = traceback.format_exception(error)[-3:]
        else:
            record["error"] = "failed on another rank"
        live.pop(name, None)
        self.say(f"{name} failed at {stage}: {record['error'].splitlines()[0][:300]}")

    def parity(self, spec: Any, seq_len: int, live: dict, prepared: dict, out: dict) -> None:
        from benchmarks.common import current_grads
        from benchmarks.methods import Reference

        ids = self.batch(spec, seq_len)
        reference = Reference(spec, self.ctx.device, self.ctx.dtype)
        ref_loss, ref_grads = reference.run(ids, self.ctx.autocast)
        del reference
        for name, step in prepared.items():
            model = live[name].model
            model.zero_grad(set_to_none=True)
            loss = step.forward()
            step.backward(loss)
            reported = step.reported_loss(loss)
            out[name]["parity"] = {
                "seq_len": seq_len,
                "reference_loss": ref_loss,
                "loss": reported,
                "loss_rel_err": abs(reported - ref_loss) / abs(ref_loss),
                "grad_rel_err": grad_rel_err(current_grads(model), ref_grads),
            }
            model.zero_grad(set_to_none=True)

    def headline(self, seq_len: int, live: dict, prepared: dict, out: dict) -> None:
        for name, step in prepared.items():
            out[name]["saved"] = {
                "seq_len": seq_len,
                **saved_for_backward(step.forward, live[name].model, step.backward),
            }
        names = list(prepared)
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(self.args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                live[name].model.zero_grad(set_to_none=True)
                self.dist.barrier()
                times[name].append(self.step(live[name], prepared[name]))
        for name in names:
            figures = {
                "seq_len": seq_len,
                "step_times_s": times[name],
                "median_step_s": statistics.median(times[name]),
                "min_step_s": min(times[name]),
            }
            for reference in PAIRED_REFERENCES:
                if reference in times:
                    figures[f"paired_ratio_vs_{reference}"] = statistics.median(
                        paired_ratios(times[name], times[reference])
                    )
            out[name]["timing"] = figures
            live[name].model.zero_grad(set_to_none=True)

    # the longest trainable length

    def search(self, method: Any, record: dict) -> dict:
        if self.args.search == "oom":
            return self.search_oom(method, record)
        return self.search_budget(method, record)

    def budget_bytes(self) -> float:
        if self.args.budget_mib:
            return self.args.budget_mib * MiB
        # several GPUs without --budget-mib: 90% of the memory, less what is held already (every method's
        # parameters; the peak is counted above it)
        _, total = self.torch.cuda.mem_get_info()
        return 0.9 * total - self.torch.cuda.memory_allocated()

    def search_budget(self, method: Any, record: dict) -> dict:
        """Longest length whose measured per-rank peak (max over ranks) fits the budget."""
        budget, args = self.budget_bytes(), self.args
        points = {int(s): self.max_over_ranks(f["alloc_peak_bytes"]) for s, f in record["lengths"].items()}
        cap = method.spec.max_len if method.spec.family == "gpt" else None
        result: dict[str, Any] = {"budget_bytes": budget, "measure": "allocator peak", "searched": []}
        for _ in range(args.search_steps):
            candidate = next_candidate(points, budget, args.granularity, args.search_tolerance, cap)
            if candidate is None or self.past_deadline():
                break
            error = None
            try:
                _, figures = self.measure_length(method, candidate, for_search=True)
                record["lengths"][str(candidate)] = figures
            except Exception as exc:
                error = exc
            if not self.all_ok(error is None):
                result["error"] = (
                    f"{type(error).__name__}: {error}"[:2000] if error else "failed on another rank"
                )
                break
            points[candidate] = self.max_over_ranks(figures["alloc_peak_bytes"])
            result["searched"].append(candidate)
        under = [s for s, peak in points.items() if peak <= budget]
        over = [s for s, peak in points.items() if peak > budget]
        result.update(
            max_len=max(under) if under else None,
            first_over=min(over) if over else None,
            capped_at_model_limit=bool(cap and under and max(under) >= cap),
            points={str(s): points[s] for s in sorted(points)},
        )
        return result

    def search_oom(self, method: Any, record: dict) -> dict:
        """One rank: double the length until a real out-of-memory error, then bisect."""
        torch, args = self.torch, self.args
        fits = sorted(int(s) for s in record["lengths"])
        lo, hi = (fits[-1] if fits else None), None
        result: dict[str, Any] = {"measure": "real CUDA out-of-memory", "searched": []}
        for _ in range(args.search_steps):
            if self.past_deadline():
                break
            if hi is None:
                candidate = 2 * lo if lo else args.granularity
            else:
                candidate = (lo + hi) // 2 // args.granularity * args.granularity
                if candidate <= lo:
                    break
            error = None
            try:
                _, figures = self.measure_length(method, candidate, for_search=True)
                record["lengths"][str(candidate)] = figures
                lo = candidate
            except Exception as exc:  # out of memory anywhere: in a kernel, the allocator or Inductor
                error = None if is_out_of_memory(exc) else exc
                hi = candidate
            finally:
                method.model.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
            result["searched"].append(candidate)
            if error is not None:
                result["error"] = f"{type(error).__name__}: {error}"[:2000]
                break
        result.update(max_len=lo, first_over=hi)
        return result


# --------------------------------------------------------------------------------------------------
# entry points


def worker_main(args: argparse.Namespace) -> None:
    worker = Worker(args)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    results = worker.run()
    dist = worker.dist
    gathered: list | None = [None] * worker.world if worker.rank == 0 else None
    dist.gather_object({"rank": worker.rank, "results": results}, gathered, dst=0)
    if worker.rank == 0:
        report = {
            "suite": args.suite,
            "command": bench_command("benchmarks.run", sys.argv[1:]),
            "machine": {**machine_info(), "loadavg_at_start": load_at_start},
            "code": code_version(),
            **plan(args),
            "wall_s_worker": round(time.monotonic() - worker.start, 1),
        }
        report = assemble(report, sorted(gathered, key=lambda r: r["rank"]))
        write_outputs(report, args.out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = worker_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args), indent=1))
        return 0
    return launch_or_work("benchmarks.run", argv, args, write_report=write_outputs, work=worker_main)


if __name__ == "__main__":
    sys.exit(main())
