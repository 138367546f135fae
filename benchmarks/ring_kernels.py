"""Ring attention's block kernels on one device: parity with SDPA, time and peak memory against the
dense fp32 fallback (Note [Ring block kernels] in ``lightning_autosp/compiler/runtime/ring_kernels.py``).

    python -m benchmarks.ring_kernels                      # CUDA: the H200 check of benchmarks/gpu_check.sh
    python -m benchmarks.ring_kernels --device cpu --quick # the same code path, tiny, on the CPU

In one process, R ring ranks run as threads: the ``autosp::ring_attention`` op and its backward run as
they do under AutoSPStrategy, with ``torch.distributed``'s point-to-point calls replaced by in-process
queues (``LocalRing``). Each configuration (dtype, head dim, GQA, which kernels are enabled) runs a
causal zigzag ring over a global sequence and compares every rank's output and q/k/v gradients with
``F.scaled_dot_product_attention`` of the whole sequence computed in fp32 (relative to the largest
reference value); it records the kernels the blocks used, the median time of forward + backward of all
ranks, and the peak device memory. The "dense" rows force the fp32 fallback on the same inputs: what
ring attention cost before it ran on the kernels. Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, code_version, machine_info
from lightning_autosp.compiler.runtime import ops, ring, ring_kernels
from lightning_autosp.compiler.runtime.ring import ring_args
from lightning_autosp.data import SequenceShard

MiB = 2**20
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Config:
    name: str
    dtype: torch.dtype
    head_dim: int = 128
    heads: int = 8  # q heads of one Ulysses rank
    kv_heads: int = 2
    flash: bool = True  # torch.backends.cuda.enable_flash_sdp
    dense: bool = False  # force the fp32 fallback for every block


CONFIGS = [
    Config("bf16", torch.bfloat16),
    Config("bf16 dense", torch.bfloat16, dense=True),
    Config("fp16, head dim 100 (padded to 104)", torch.float16, head_dim=100),
    Config("bf16, flash off", torch.bfloat16, flash=False),
    Config("fp32", torch.float32, head_dim=64),
    Config("fp32 dense", torch.float32, head_dim=64, dense=True),
]


class LocalRing:
    """``torch.distributed``'s isend/irecv between threads of one process (one thread per ring rank)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.boxes: dict[tuple[int, int, int], queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()

    def _box(self, source: int, destination: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes[(source, destination, tag)]

    def isend(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_dst: int = 0) -> Any:
        self._box(self.local.rank, group_dst, tag).put(tensor.clone())
        return _Request(lambda: None)

    def irecv(self, tensor: torch.Tensor, group: Any = None, tag: int = 0, group_src: int = 0) -> Any:
        box = self._box(group_src, self.local.rank, tag)
        return _Request(lambda: tensor.copy_(box.get(timeout=120)))


@dataclass
class _Request:
    finish: Callable[[], Any]

    def wait(self) -> None:
        self.finish()


def run_ring(world: int, fn: Callable[[int], Any]) -> list[Any]:
    comm, results, errors = LocalRing(), [None] * world, []

    def worker(rank: int) -> None:
        comm.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # re-raised below
            errors.append(error)

    with mock.patch.object(ring, "dist", comm), mock.patch.object(ops, "_group", lambda name: None):
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return results


@contextmanager
def kernels_used(config: Config) -> Iterator[Counter]:
    """Count the kernel of every block; force the dense fallback for ``config.dense``."""
    used: Counter = Counter()
    choose = ring_kernels.choose_kernel

    def counted(masked: bool, query: torch.Tensor, value: torch.Tensor) -> tuple:
        name, reason = ("dense", "forced by the benchmark") if config.dense else choose(masked, query, value)
        used[name] += 1
        return name, reason

    flash = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(config.flash)
    try:
        with (
            mock.patch.object(ring, "choose_kernel", counted),
            mock.patch.object(ring_kernels, "_warned", set()),
        ):
            yield used
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)


def measure(config: Config, seq_len: int, ring_degree: int, repeats: int, device: torch.device) -> dict:
    generator = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(1, config.heads, seq_len, config.head_dim)] + [
        (1, config.kv_heads, seq_len, config.head_dim)
    ] * 2
    full = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
    grad_out = torch.randn(shapes[0], generator=generator).to(device)
    reference = [(t.double() if device.type == "cpu" else t.float()).requires_grad_() for t in full]
    # K/V repeated to the q heads by hand: SDPA's enable_gqa would take the math path (S x S) in fp32
    groups = config.heads // config.kv_heads
    expanded = [reference[0], *(t.repeat_interleave(groups, dim=1) for t in reference[1:])]
    expected = F.scaled_dot_product_attention(*expanded, is_causal=True)
    expected_grads = torch.autograd.grad(expected, reference, grad_out.to(expected.dtype))
    shards = [
        SequenceShard.for_ring(seq_len, ring_degree, r, ring_degree, "zigzag") for r in range(ring_degree)
    ]
    inputs = [t.to(config.dtype) for t in full]

    def rank_fn(rank: int) -> tuple:
        index = torch.tensor(shards[rank].positions(), device=device)
        local = [t[:, :, index].detach().requires_grad_() for t in inputs]
        out, _ = torch.ops.autosp.ring_attention(
            *local, None, True, None, *ring_args(shards[rank])[:2], rank, "local"
        )
        grads = torch.autograd.grad(out, local, grad_out[:, :, index].to(config.dtype))
        return index, out.detach(), grads

    def step() -> list:
        return run_ring(ring_degree, rank_fn)

    with kernels_used(config) as used:
        results = step()  # warm-up, and the values checked
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) / MiB if device.type == "cuda" else None
    errors = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    key_grads = [torch.zeros_like(t, dtype=torch.float64) for t in reference[1:]]

    def rel(actual: torch.Tensor, wanted: torch.Tensor) -> float:
        return float((actual.double() - wanted.double()).abs().max() / wanted.double().abs().max())

    for index, out, (grad_q, grad_k, grad_v) in results:
        errors["out"] = max(errors["out"], rel(out, expected.detach()[:, :, index]))
        errors["dq"] = max(errors["dq"], rel(grad_q, expected_grads[0][:, :, index]))
        key_grads[0][:, :, index] = grad_k.double()
        key_grads[1][:, :, index] = grad_v.double()
    errors["dk"], errors["dv"] = rel(key_grads[0], expected_grads[1]), rel(key_grads[1], expected_grads[2])
    return {
        **{k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(config).items()},
        "seq_len": seq_len,
        "ring_degree": ring_degree,
        "kernels": dict(used),
        "errors": errors,
        "passed": max(errors.values()) <= TOLERANCE[config.dtype],
        "ms": 1000 * statistics.median(times) if times else None,
        "peak_mib": peak,
    }


def to_markdown(report: dict) -> str:
    machine = report["machine"]
    where = machine.get("gpu") or f"{machine.get('cpu_count')} CPUs, {machine.get('processor')}"
    lines = [
        f"Ring attention blocks on {report['device']} ({where}), torch {machine.get('torch')}, commit "
        f"{(report['code'].get('commit') or '')[:10]}; causal, zigzag, {report['ring_degree']} ring ranks in "
        f"one process, {report['seq_len']} tokens, batch 1, q heads / K/V heads per rank as listed. Errors: "
        "max |ring - SDPA in fp32| / max |SDPA|, over every rank's output and q/k/v gradients.",
        "",
        "| config | kernels (blocks) | out err | dq err | dk err | dv err | passed | fwd+bwd ms | peak MiB |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | failed: {row['error']} | | | | | no | | |")
            continue
        e = row["errors"]
        kernels = ", ".join(f"{k} ({n})" for k, n in row["kernels"].items())
        peak = f"{row['peak_mib']:.0f}" if row["peak_mib"] is not None else "-"
        lines.append(
            f"| {row['name']} | {kernels} | {e['out']:.1e} | {e['dq']:.1e} | {e['dk']:.1e} | {e['dv']:.1e} | "
            f"{'yes' if row['passed'] else '**no**'} | {row['ms']:.1f} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--ring", type=int, default=4, help="ring ranks (threads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="256 tokens, 2 ring ranks, 1 repeat")
    parser.add_argument("--out", type=Path, default=RESULTS / "ring_kernels.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.ring, args.repeats = 256, 2, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu (--quick) to run the code path on the CPU")
    report: dict[str, Any] = {
        "device": args.device,
        "seq_len": args.seq_len,
        "ring_degree": args.ring,
        "machine": machine_info(),
        "code": code_version(),
        "rows": [],
    }
    for config in CONFIGS:
        try:
            row = measure(config, args.seq_len, args.ring, args.repeats, device)
        except Exception as error:  # recorded, so one failing kernel does not hide the others
            row = {"name": config.name, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))
    return 0 if all(row.get("passed") for row in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
