"""A benchmark started from a process that already holds a rank still launches its own workers.

CI ran the smoke suite from a pytest worker in which an earlier in-process Lightning run had left
``LOCAL_RANK`` behind; the benchmark took itself for a torchrun worker and failed in ``init_process_group``.
"""

from __future__ import annotations

import json

from benchmarks import common


def test_an_inherited_rank_does_not_make_a_worker(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("AUTOSP_BENCH_ARGV", raising=False)
    assert not common.is_bench_worker()
    assert common.worker_argv(["--suite", "smoke"]) == ["--suite", "smoke"]


def test_a_relaunched_worker_reads_its_arguments(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("AUTOSP_BENCH_ARGV", json.dumps(["--suite", "tiny"]))
    assert common.is_bench_worker()
    assert common.worker_argv([]) == ["--suite", "tiny"]


def test_the_relaunch_drops_the_launcher_variables_it_inherited(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(name, "7")
    seen: dict = {}

    def run(command, cwd, env):
        seen.update(env)

        class Done:
            returncode = 0

        return Done()

    monkeypatch.setattr(common.subprocess, "run", run)
    assert common.relaunch_under_torchrun("benchmarks.run", [], nproc=2, threads=1, command="x") == 0
    assert not set(common.LAUNCHER_VARIABLES) & set(seen)
    assert seen["AUTOSP_BENCH_COMMAND"] == "x"
