"""What ``pip install lightning_autosp`` pulls in, and what a missing optional package says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_autosp import MemoryMonitor

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Imported by examples, benchmarks or MemoryMonitor's summary only, never by the strategy.
OPTIONAL = {"deepspeed", "torchmetrics", "matplotlib", "rich", "transformers", "flash-attn"}


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def _extra(name: str) -> set[str]:
    """Packages an extra installs, through the extras it names (``lightning_autosp[hf,plot]``)."""
    names = set()
    for requirement in map(Requirement, PROJECT["optional-dependencies"][name]):
        if requirement.name == PROJECT["name"]:
            names |= set().union(*map(_extra, requirement.extras))
        else:
            names.add(requirement.name)
    return names


def test_optional_packages_are_in_the_extras_that_use_them() -> None:
    assert _names(PROJECT["dependencies"]) & OPTIONAL == set()
    assert {"deepspeed", "transformers", "matplotlib"} <= _extra("bench")
    assert {"matplotlib", "rich"} == _extra("plot")
    assert {"torchmetrics", "transformers", "matplotlib", "rich"} <= _extra("examples")
    # The test suite runs the examples and the benchmark smoke tests.
    assert _extra("examples") | _extra("bench") <= _extra("test")


def test_torch_is_capped_at_the_tested_version() -> None:
    """The compiler uses private torch APIs: the range must be the version this suite runs on."""
    (torch_requirement,) = (r for r in map(Requirement, PROJECT["dependencies"]) if r.name == "torch")
    tested = Version(torch.__version__.split("+")[0])
    assert torch_requirement.specifier.contains(tested), (torch_requirement, tested)
    untested_next = Version(f"{tested.major}.{tested.minor + 1}")
    untested_previous = Version(f"{tested.major}.{tested.minor - 1}")
    assert not torch_requirement.specifier.contains(untested_next), torch_requirement
    assert not torch_requirement.specifier.contains(untested_previous), torch_requirement


@pytest.mark.slow
def test_no_module_of_the_package_imports_an_optional_package() -> None:
    # matplotlib, rich and transformers are left out: lightning imports them whenever they are installed.
    optional = ["deepspeed", "flash_attn"]
    code = (
        "import importlib, pkgutil, sys\n"
        "import lightning_autosp\n"
        "for module in pkgutil.walk_packages(lightning_autosp.__path__, 'lightning_autosp.'):\n"
        "    importlib.import_module(module.name)\n"
        "lightning_autosp.MemoryMonitor(plot=False, print_table=False)\n"
        f"print(sorted(name for name in {optional!r} if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize(
    ("hidden", "make", "match"),
    [
        (
            "matplotlib",
            lambda: MemoryMonitor(print_table=False),
            r"MemoryMonitor\(plot=True\) needs matplotlib",
        ),
        ("rich", lambda: MemoryMonitor(plot=False), r"MemoryMonitor\(print_table=True\) needs rich"),
    ],
)
def test_memory_monitor_names_the_plot_extra_when_it_is_made(
    monkeypatch: pytest.MonkeyPatch, hidden: str, make, match: str
) -> None:
    monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(ModuleNotFoundError, match=rf"{match}.*lightning_autosp\[plot\]'.*, or pass"):
        make()


def test_examples_and_benchmarks_name_their_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import report, sac
    from examples.models import LlamaModule

    for name in ("transformers", "deepspeed", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError, match=r"LlamaModule needs transformers.*lightning_autosp\[hf\]"):
        LlamaModule()
    with pytest.raises(ModuleNotFoundError, match=r"needs deepspeed.*lightning_autosp\[bench\]"):
        sac.deepspeed_sac().__enter__()
    assert "lightning_autosp[bench]" in sac.deepspeed_status()["reason"]
    with pytest.raises(ModuleNotFoundError, match=r"needs matplotlib.*lightning_autosp\[bench\]"):
        report.plot({}, ROOT / "unused.png")


def test_the_license_is_declared_and_shipped() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
