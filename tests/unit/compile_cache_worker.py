"""Compile one small training step per SAC setting with Inductor, and print what ``explain()`` reports.

    TORCHINDUCTOR_CACHE_DIR=<dir> python tests/unit/compile_cache_worker.py True False auto

One JSON line per setting: the strategy's ``explain()`` and how many compiled graphs Inductor's FX graph
cache served. Run in a fresh process per launch so that a second launch meets only the on-disk caches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autosp import AutoSPStrategy  # noqa: E402

SETTINGS = {"True": True, "False": False, "auto": "auto"}


def main(settings: list[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    for setting in settings:
        torch._dynamo.reset()
        counters.clear()
        strategy = AutoSPStrategy(sp_size=1, compiler="inductor", sac=SETTINGS[setting], chunked_loss=False)
        step = torch.compile(lambda: model(x).square().mean(), backend=strategy.backend_for(None))
        step().backward()
        cache_hits = counters["inductor"]["fxgraph_cache_hit"]
        print(json.dumps({"sac": setting, "explain": strategy.explain(), "fx_graph_cache_hits": cache_hits}))


if __name__ == "__main__":
    main(sys.argv[1:])
