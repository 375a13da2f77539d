"""docs/architecture.md walks one round through the code, and engine/runner.py opens with its short
version: every ``file::name`` either cites must exist."""

from __future__ import annotations

import ast
import re

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
#: the runner's module docstring: the life of a round, hop by hop
BASE = ROOT / "engine" / "runner.py"
REFERENCE = re.compile(r"`([\w/]+\.py)::([\w.]+)`")


def defined_names(path) -> set[str]:
    """Top-level functions, classes and assignments of ``path``, and ``Class.method`` for methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(
                    f"{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                )
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_checker_finds_a_missing_name(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self):\n        pass\n\n\ndef g():\n    pass\n")
    assert {"A", "A.f", "g"} <= defined_names(module) and "A.h" not in defined_names(module)


def test_every_cited_function_exists():
    cited = REFERENCE.findall(DOC.read_text())
    assert len(cited) > 30  # the walk-through cites the path step by step
    missing = [f"{path}::{name}" for path, name in cited if name not in defined_names(ROOT / path)]
    assert missing == []


def test_every_hop_of_the_runners_life_of_a_round_exists():
    cited = REFERENCE.findall(ast.get_docstring(ast.parse(BASE.read_text())))
    assert len(cited) >= 10
    assert [f"{p}::{n}" for p, n in cited if n not in defined_names(ROOT / p)] == []
