"""The package's shape: its import graph has no cycle and no module grows much past 500 lines."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_autosp"
MAX_LINES = 550  # "no module much over 500 lines"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runs_on_import(node: ast.If) -> bool:
    """False for ``if TYPE_CHECKING:`` and ``if __name__ == "__main__":``, whose bodies import never runs."""
    test = ast.unparse(node.test)
    return "TYPE_CHECKING" not in test and "__main__" not in test


def _imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """Package modules a module imports anywhere that an import of it can reach (functions included)."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and not _runs_on_import(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            # ``from package import module`` names a module; ``from module import name`` the module itself
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        pending.extend(ast.iter_child_nodes(node))
    return found


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imported(ast.parse(path.read_text()), modules) - {name} for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as importer -> imported -> ... -> importer, or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1][::-1]  # graphlib lists each module before the module importing it
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = _import_graph()
    # the walk sees imports
    assert "lightning_autosp.compiler.prove.analysis" in graph["lightning_autosp.compiler.sp_pass"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_grows_much_past_500_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules by what they do: {long}"


# What each stage of the compiler may import from the others (docs/contributing.md, "Where the code is"):
# the analysis decides before anything is rewritten, so it imports no rewrite, partitioner or runtime code;
# the collectives that lowering inserts and the partitioner reads import neither of them.
STAGE_IMPORTS = {
    "prove": set(),
    "runtime": {"prove"},
    "lower": {"prove", "runtime"},
    "partition": {"runtime"},
}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "compiler" and parts[2] in STAGE_IMPORTS else None


def test_compiler_stages_import_only_the_stages_before_them() -> None:
    graph = _import_graph()
    assert {_stage(m) for m in graph} >= set(STAGE_IMPORTS)
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imports in graph.items()
        if (stage := _stage(module)) is not None
        for imported in imports
        if (other := _stage(imported)) not in (None, stage) and other not in STAGE_IMPORTS[stage]
    )
    assert not wrong, wrong


def test_lowering_raises_no_refusal() -> None:
    """Note [Refusals before rewriting]: every refusal comes from the analysis, before any rewrite."""
    lowering = sorted((PACKAGE / "compiler" / "lower").glob("*.py"))
    assert lowering
    raising = [
        f"{path.name}:{node.lineno}"
        for path in lowering
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Raise) and node.exc is not None and "Refusal" in ast.unparse(node.exc))
        or (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("refuse"))
    ]
    assert not raising, raising


def test_rules_decide_and_never_write_the_plan() -> None:
    """Note [Proving a graph exact]: a rule returns a decision; the analysis alone records it in the plan."""
    rules = sorted((PACKAGE / "compiler" / "prove" / "rules").glob("*.py"))
    assert rules
    writing = [
        f"{path.name}:{node.lineno}"
        for path in rules
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "plan"
    ]
    assert not writing, writing
