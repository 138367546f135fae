"""The suites of ``benchmarks.run``: which models, methods, lengths and budget each measures, and where.

A suite's entries are the defaults of ``benchmarks.run``'s options; an option given on the command line
overrides its suite's entry, and ``DEFAULTS`` fills what neither gives.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS

SUITES: dict[str, dict[str, Any]] = {
    "cpu": {
        "models": ["gpt-tiny", "llama-tiny"],
        "methods": ["sac", "sp", "deepspeed", "ulysses", "ddp", "ring"],
        "seq_lens": [1024, 2048, 4096],
        "headline_len": 4096,
        "parity_len": 4096,
        "repeats": 5,
        "budget_mib": 32.0,
        "search": "budget",
        "granularity": 128,
        "nproc": 2,
        "threads": 1,
        "compiler": "inductor",
        "dtype": "float32",
        "device": "cpu",
    },
    # benchmarks.trainability: 8-layer models, every method, the longest length within one budget
    "trainability": {
        "models": ["gpt-tiny", "llama-tiny", "llama3-proportions"],
        "layers": 8,
        "methods": ["sac", "longest", "sp", "ulysses", "alst", "ddp", "deepspeed"],
        "seq_lens": [1024, 2048],
        "headline_len": 2048,
        "parity_len": 1024,
        "repeats": 5,
        "budget_mib": 64.0,
        "search": "budget",
        "granularity": 256,
        "search_steps": 3,
        "nproc": 2,
        "threads": 1,
        "compiler": "inductor",
        "dtype": "float32",
        "device": "cpu",
    },
    "smoke": {
        "models": ["gpt-smoke", "llama-smoke"],
        "methods": ["sac", "longest", "sp", "deepspeed", "ulysses", "alst", "ddp", "ring"],
        "seq_lens": [64],
        "headline_len": 64,
        "parity_len": 64,
        "repeats": 1,
        "profiled_steps": 1,
        "search": "none",
        "nproc": 2,
        "threads": 1,
        "compiler": "aot_eager",
        "dtype": "float32",
        "device": "cpu",
    },
    "gpu": {
        "models": ["llama-1b"],
        "layers": 4,
        "methods": ["sac", "longest_offload", "sp", "ddp", "deepspeed", "ulysses", "ring"],
        "seq_lens": [32768],
        "headline_len": 32768,
        "parity_len": 32768,
        "repeats": 3,
        "profiled_steps": 1,
        "search": "auto",  # real OOM on one GPU, the budget (--budget-mib, default 90% of memory) on several
        "granularity": 4096,
        "search_steps": 3,
        "compiler": "inductor",
        "dtype": "bfloat16",
        "device": "cuda",
        "deadline_s": 330.0,
    },
}
DEFAULTS = {
    "layers": None,
    "autocast": "none",
    "batch_size": 1,
    "profiled_steps": 2,
    "budget_mib": None,
    "granularity": 128,
    "search_steps": 3,
    "search_tolerance": 0.1,
    "deadline_s": 0.0,
    "threads": 1,
    "nproc": None,
}
METHOD_NAMES = (
    "sac",
    "longest",
    "longest_offload",
    "sp",
    "deepspeed",
    "ulysses",
    "alst",
    "ddp",
    "ring",
)  # methods.METHODS
REFERENCE_METHOD = "ulysses"  # step-time ratios are against hand-written Ulysses
PAIRED_REFERENCES = (REFERENCE_METHOD, "sp", "alst")  # per-round ratios are kept against these


def parse_launch_args(argv: list[str], description: str = "") -> argparse.Namespace:
    """``benchmarks.run``'s options, a suite's entries filling what the command line leaves out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    parser.add_argument("--models", nargs="+", help="presets of benchmarks/models.py")
    parser.add_argument("--layers", type=int, help="cut every model to this many layers")
    parser.add_argument("--methods", nargs="+", help="of: sac longest sp deepspeed ulysses alst ddp ring")
    parser.add_argument("--seq-lens", nargs="+", type=int)
    parser.add_argument("--headline-len", type=int, help="length of the timed and saved-bytes figures")
    parser.add_argument("--parity-len", type=int, help="length of the single-device parity check")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--profiled-steps", type=int, help="CPU peak: least of this many profiled steps")
    parser.add_argument("--budget-mib", type=float, help="per-rank memory budget of the length search")
    parser.add_argument("--search", choices=("budget", "oom", "auto", "none"))
    parser.add_argument("--granularity", type=int, help="searched lengths are multiples of this")
    parser.add_argument("--search-steps", type=int, help="lengths the search may measure per method")
    parser.add_argument("--search-tolerance", type=float, help="stop when over/under <= 1 + this")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="of the parameters")
    parser.add_argument("--autocast", choices=("none", "bfloat16"), help="bfloat16: bf16-mixed precision")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--nproc", type=int, help="ranks (default: 2 on CPU, every GPU on CUDA)")
    parser.add_argument("--threads", type=int, help="torch threads per rank")
    parser.add_argument("--deadline-s", type=float, help="start no new work after this many seconds")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/<suite>.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    args = parser.parse_args(argv)
    for key, value in {**DEFAULTS, **SUITES[args.suite]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out = args.out or RESULTS / f"{args.suite}.json"
    if args.nproc is None:
        args.nproc = _gpu_count() if args.device == "cuda" else 2
    unknown = set(args.methods) - set(METHOD_NAMES)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}")
    for length in (args.headline_len, args.parity_len):
        if length not in args.seq_lens:
            args.seq_lens.append(length)
    args.seq_lens = sorted(set(args.seq_lens))
    if args.search == "auto":
        args.search = "oom" if args.nproc == 1 else "budget"
    if args.search == "oom" and args.nproc != 1:
        parser.error("--search oom needs --nproc 1: an out-of-memory error on one rank would hang the others")
    return args


def _gpu_count() -> int:
    import torch

    return max(torch.cuda.device_count(), 1)
