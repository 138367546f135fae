"""The suites of ``benchmarks.run``: which models, methods, lengths and budget each measures, and where.

A suite's entries are the defaults of ``benchmarks.run``'s options; an option given on the command line
overrides its suite's entry, and ``DEFAULTS`` fills what neither gives.
"""

from __future__ import annotations

from typing import Any

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
        "methods": ["sac", "sp", "ulysses", "alst", "ddp", "deepspeed"],
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
        "methods": ["sac", "sp", "deepspeed", "ulysses", "alst", "ddp", "ring"],
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
        "methods": ["sac", "sp", "ddp", "deepspeed", "ulysses", "ring"],
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
REFERENCE_METHOD = "ulysses"  # step-time ratios are against hand-written Ulysses
PAIRED_REFERENCES = (REFERENCE_METHOD, "sp")  # per-round ratios are kept against these
