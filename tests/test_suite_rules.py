"""Rules the test suite keeps so that a slow or busy machine cannot fail it.

Every timeout is a hang guard, minutes long; no assertion puts an upper bound on a measured time. The
suite runs on 2 CPU cores shared with other jobs, where a test can take several times its usual time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import tomllib

TESTS = Path(__file__).resolve().parent
SUITE_TIMEOUT_S = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"
]["timeout"]
# Waits inside a test (a subprocess, a barrier between simulated ranks) end before the test's own
# timeout, so that the test can report the output of what hung.
INNER_WAIT_FLOOR_S = 240
TIME_WORDS = ("seconds", "elapsed", "duration")


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(TESTS.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _constants(module: ast.Module) -> dict[str, object]:
    found: dict[str, object] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _number(node.value, found)
            if value is not None:
                found[node.targets[0].id] = value
    return found


def _number(node: ast.expr, constants: dict[str, object]) -> float | None:
    """The value of a numeric expression of literals and module constants, else None."""
    try:
        value = eval(
            compile(ast.Expression(node), "<timeout>", "eval"), {"__builtins__": {}}, dict(constants)
        )
    except Exception:
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(TESTS.parent)}:{node.lineno}"


def _is_timeout_mark(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "timeout"
        and ast.unparse(func.value) == "pytest.mark"
    )


def test_every_timeout_is_a_hang_guard() -> None:
    short = []
    for path, module in _modules():
        constants = _constants(module)
        for node in ast.walk(module):
            if isinstance(node, ast.Call) and _is_timeout_mark(node) and node.args:
                seconds = _number(node.args[0], constants)
                if seconds is None or seconds < SUITE_TIMEOUT_S:
                    short.append(f"{_where(path, node)}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    seconds = _number(keyword.value, constants) if keyword.arg == "timeout" else None
                    if seconds is not None and seconds < INNER_WAIT_FLOOR_S:
                        short.append(f"{_where(path, node)}: {ast.unparse(node)}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.args, *node.args.kwonlyargs]
                defaults = [*[None] * (len(node.args.args) - len(node.args.defaults)), *node.args.defaults]
                defaults += node.args.kw_defaults
                for argument, default in zip(arguments, defaults):
                    seconds = _number(default, constants) if default is not None else None
                    if argument.arg == "timeout" and seconds is not None and seconds < INNER_WAIT_FLOOR_S:
                        short.append(f"{_where(path, node)}: {argument.arg}={ast.unparse(default)}")
    assert not short, "timeouts too short to be hang guards:\n" + "\n".join(short)


def _mentions_time(node: ast.expr) -> bool:
    text = ast.unparse(node).lower()
    return any(word in text for word in TIME_WORDS)


def test_no_assertion_bounds_a_measured_time_from_above() -> None:
    bounded = []
    for path, module in _modules():
        for node in ast.walk(module):
            if not isinstance(node, ast.Assert):
                continue
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [compare.left, *compare.comparators]
                for op, left, right in zip(compare.ops, operands, operands[1:]):
                    below = isinstance(op, (ast.Lt, ast.LtE)) and _mentions_time(left)
                    above = isinstance(op, (ast.Gt, ast.GtE)) and _mentions_time(right)
                    if below or above:
                        bounded.append(f"{_where(path, node)}: {ast.unparse(node.test)}")
    assert not bounded, "assertions that fail on a slow machine:\n" + "\n".join(bounded)
