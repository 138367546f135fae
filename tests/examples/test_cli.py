"""``autosp fit`` end to end, run as the README says: the installed console script, from the repository root.

The fit tests start 2 CPU processes through Lightning's launcher; the GPU configs are only parsed.

Each run trains 2 steps and checks the CSV logger's columns: ``train_loss`` and every rank's memory from
``MemoryMonitor``. ``AUTOSP_DEBUG=1`` makes rank 0 log what the compiler rewrote, which shows that the run
really was sequence parallel.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLI_HANG_GUARD_S = 600  # a hang guard, many times what a run takes
# Variables a surrounding launcher may have set; the CLI must pick its own port and ranks.
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def autosp_script() -> Path:
    """The ``autosp`` console script that ``pip install -e .`` put next to this interpreter."""
    script = Path(sysconfig.get_path("scripts")) / "autosp"
    if not script.exists():
        pytest.fail(f"No autosp console script in {script.parent}; run `pip install -e .` here first.")
    return script


def run_cli(tmp_path: Path, *args: str, expect_code: int = 0) -> str:
    """Run the installed ``autosp`` console script from the repository root, as the README does.

    Not ``python -m``, which would put the working directory on ``sys.path`` by itself. The only entry on
    ``PYTHONPATH`` is a directory holding a link to this checkout's ``lightning_autosp``, so the script runs
    this checkout's code whichever checkout is installed, while ``examples`` and ``tests`` can only come
    from the working directory.
    """
    import_root = tmp_path / "import_root"
    import_root.mkdir()
    (import_root / "lightning_autosp").symlink_to(REPO / "lightning_autosp", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("PL_")}
    env.update(AUTOSP_DEBUG="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(import_root))
    result = subprocess.run(
        [str(autosp_script()), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_HANG_GUARD_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == expect_code, output[-6000:]
    return output


def without_wrapping(text: str) -> str:
    """``text`` without whitespace or a rich panel's side borders: a phrase is found wherever it wrapped."""
    return re.sub(r"[\s│]", "", text)


def logged_rows(save_dir: Path) -> list[dict[str, str]]:
    (metrics,) = save_dir.rglob("metrics.csv")
    with metrics.open(newline="") as f:
        return list(csv.DictReader(f))


def values(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def assert_sequence_parallel_run(output: str, rows: list[dict[str, str]], steps: int) -> None:
    # Rank 0 only, once: the first training step of the single sequence layout.
    assert output.count("AutoSP (AUTOSP_DEBUG=1), after the first training_step") == 1, output[-4000:]
    assert "all-to-alls inserted" in output
    assert len(values(rows, "train_loss")) == steps
    for rank in (0, 1):
        for stat in ("peak_rss_mib", "params_mib", "grads_mib"):
            assert values(rows, f"memory/rank_{rank}/{stat}"), f"no memory/rank_{rank}/{stat} column"
    assert not any(key.startswith("memory/rank_2/") for key in rows[0])


@pytest.mark.distributed
@pytest.mark.timeout(CLI_HANG_GUARD_S + 60)
def test_autosp_fit_cpu_demo_config(tmp_path: Path) -> None:
    # seq_len 96: 48 tokens per rank. (64 would give 32, which is also the tiny Llama's head size, and the
    # SP pass refuses shapes where the per-rank length is ambiguous.)
    output = run_cli(
        tmp_path,
        "fit",
        "--config=examples/configs/cpu_demo.yaml",
        "--trainer.max_steps=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--data.seq_len=96",
        "--data.max_bytes=262144",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    )
    rows = logged_rows(tmp_path)
    assert_sequence_parallel_run(output, rows, steps=2)
    assert "Memory per rank" in output  # MemoryMonitor's table at the end of fit
    (config,) = tmp_path.rglob("config.yaml")  # LightningCLI saved the resolved config next to the CSV
    assert yaml.safe_load(config.read_text())["trainer"]["strategy"]["init_args"]["sp_size"] == 2


@pytest.mark.distributed
@pytest.mark.timeout(CLI_HANG_GUARD_S + 60)
def test_strategy_given_by_name(tmp_path: Path) -> None:
    """``strategy: autosp`` in a config; also validates the hand-written GPT under SP (val_loss, val_ppl)."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "autosp",
            "max_steps": 2,
            "log_every_n_steps": 1,
            "val_check_interval": 2,
            "check_val_every_n_epoch": None,
            "limit_val_batches": 2,
            "num_sanity_val_steps": 0,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path)},
            },
            "callbacks": [
                {
                    "class_path": "lightning_autosp.MemoryMonitor",
                    "init_args": {"every_n_steps": 1, "plot": False, "print_table": False},
                },
                {"class_path": "tests.examples.cli_helpers.CompileWithAotEager"},
                {"class_path": "lightning_autosp.SequenceThroughputMonitor", "init_args": {"window_size": 2}},
            ],
        },
        "model": {
            "class_path": "examples.models.GPTModule",
            "init_args": {"block_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32},
        },
        "data": {
            "class_path": "examples.data.StdlibDataModule",
            "init_args": {"seq_len": 48, "batch_size": 2, "max_bytes": 65536},
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    output = run_cli(tmp_path, "fit", f"--config={path}")
    rows = logged_rows(tmp_path)
    assert_sequence_parallel_run(output, rows, steps=2)
    # sp=2 on 2 ranks is one dp group: no whole-job figure beside the device's (Lightning's own monitor
    # would double it), and each sample counts its 48 tokens, not the 24 of a rank's shard.
    (rate,) = [row for row in rows if row.get("train/device/items_per_sec")]
    assert float(rate["train/device/items_per_sec"]) == pytest.approx(
        float(rate["train/device/samples_per_sec"]) * 48
    )
    assert not values(rows, "train/items_per_sec")
    (val_loss,) = values(rows, "val_loss")
    (val_ppl,) = values(rows, "val_ppl")
    assert val_ppl == pytest.approx(2.718281828459045**val_loss, rel=1e-4)


@pytest.mark.distributed
@pytest.mark.timeout(CLI_HANG_GUARD_S + 60)
def test_autosp_verify_cpu_demo_config(tmp_path: Path) -> None:
    # The README's first step with a new model, on the demo's config as it is (512 tokens, aot_eager, SAC,
    # chunked loss): one step on one device and under AutoSP on 2 processes, compared; exits 0 when exact.
    output = run_cli(tmp_path, "verify", "--config=examples/configs/cpu_demo.yaml", "--data.max_bytes=262144")
    assert "autosp verify: LlamaModule, sp_size=2 on 2 cpu rank(s), 512 tokens, 32-true" in output
    for row in (
        "loss, relative error",
        "gradients, relative error",
        "Worst parameters",
        "all-to-alls inserted",
    ):
        assert row in output, output[-4000:]
    assert "EXACT: sequence parallelism reproduces the single-device step" in output
    assert output.count("autosp verify:") == 1  # printed by rank 0 only


@pytest.mark.distributed
@pytest.mark.timeout(CLI_HANG_GUARD_S + 60)
def test_autosp_verify_shows_a_refusal_and_exits_1(tmp_path: Path) -> None:
    # A Python branch on the length that a shard and the whole sequence take differently: traced at the
    # shard's length only (the default, "auto", traces it again whole and is exact), the SP pass cannot
    # make it exact, so verify shows the refusal, with the user's line, and exits non-zero.
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "lightning_autosp.AutoSPStrategy",
                "init_args": {"compiler": "aot_eager", "trace_length": "shard"},
            },
        },
        "model": {
            "class_path": "tests.distributed.user_modules.SequenceIdiomGPT",
            "init_args": {"idiom": "branch_on_length"},
        },
        "data": {"class_path": "tests.examples.cli_helpers.RandomTokens", "init_args": {"seq_len": 40}},
    }
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(config))
    output = run_cli(tmp_path, "verify", f"--config={path}", "--seq_len=25", expect_code=1)
    assert "25 tokens" in output
    # The error is in a rich panel, which wraps its lines at the terminal's width, a long path mid-word: where
    # the breaks fall depends on the checkout's path, so the phrases are looked for without the wrapping.
    for phrase in ("branched on the sequence length", "tests/distributed/user_modules.py"):
        assert without_wrapping(phrase) in without_wrapping(output), output[-4000:]
    assert "REFUSED: the SP run stopped with the error above, on every rank" in output


@pytest.mark.slow
@pytest.mark.timeout(CLI_HANG_GUARD_S + 60)
@pytest.mark.parametrize("name", ["llama_1b_32k.yaml", "llama_8b_128k.yaml"])
def test_gpu_configs_resolve_their_class_paths(tmp_path: Path, name: str) -> None:
    """The README's ``autosp fit --config ...`` for the 8-GPU configs gets past parsing on a CPU machine:
    ``--print_config`` imports every class path (``examples.models.LlamaModule``) and checks its arguments."""
    output = run_cli(tmp_path, "fit", f"--config=examples/configs/{name}", "--print_config")
    printed = yaml.safe_load(output[output.index("seed_everything:") :])
    assert printed["model"]["class_path"] == "examples.models.LlamaModule"
    assert printed["trainer"]["strategy"]["init_args"]["sp_size"] == 8
