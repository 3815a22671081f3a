"""The package's parameters say their types: at most 3% of annotated parameters are ``Any``.

``python tests/test_annotations.py`` prints the count and the files that hold them.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("pipeplan", "planner", "profiler", "runtime")
MAX_ANY_SHARE = 0.03


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = function.args
    extra = [arg for arg in (args.vararg, args.kwarg) if arg is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def count_any_parameters(root: Path = ROOT) -> tuple[int, int, Counter[str]]:
    """(parameters annotated exactly ``Any``, annotated parameters, ``Any`` count per file)."""
    annotated = 0
    per_file: Counter[str] = Counter()
    for folder in PACKAGE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for arg in _parameters(node):
                    if arg.annotation is None:
                        continue
                    annotated += 1
                    if ast.unparse(arg.annotation) in ("Any", "typing.Any"):
                        per_file[str(path.relative_to(root))] += 1
    return sum(per_file.values()), annotated, per_file


def test_counter_sees_any_parameters(tmp_path: Path) -> None:
    folder = tmp_path / "pipeplan"
    folder.mkdir()
    (folder / "m.py").write_text(
        "from typing import Any\n"
        "def f(a: Any, b: int, *c: Any, d, **e: 'typing.Any') -> None: ...\n"
        "class C:\n    async def g(self, x: list[Any]) -> Any: ...\n"
    )
    assert count_any_parameters(tmp_path) == (2, 5, Counter({"pipeplan/m.py": 2}))


def test_at_most_three_percent_of_parameters_are_any() -> None:
    any_count, annotated, per_file = count_any_parameters()
    assert annotated > 1000, f"only {annotated} annotated parameters found under {PACKAGE_FOLDERS}"
    assert any_count <= MAX_ANY_SHARE * annotated, (
        f"{any_count} of {annotated} annotated parameters are Any (limit {MAX_ANY_SHARE:.0%}): "
        f"{dict(per_file.most_common(5))}"
    )


if __name__ == "__main__":
    any_count, annotated, per_file = count_any_parameters()
    print(f"{any_count} of {annotated} annotated parameters are Any ({any_count / annotated:.1%})")
    for path, count in per_file.most_common():
        print(f"  {count:4d}  {path}")
