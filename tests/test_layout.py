"""The code's shape: packages import only packages below them (:data:`LAYERS`), no import circles
between the project's modules (lazy imports inside functions included), and no method module
importing another method's module."""

from __future__ import annotations

import ast
import subprocess
import sys
from types import SimpleNamespace

from conftest import ROOT

PACKAGES = ("bench", "client_app", "common", "engine", "methods", "models", "privacy", "server_app", "tools")


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports anywhere in its body but under ``if
    TYPE_CHECKING:`` (``from x import y`` counts ``x.y`` when that is a module)."""
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py"
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        tree = ast.parse(path.read_text())
        type_only = {  # imports under ``if TYPE_CHECKING:`` are for annotations: they never run
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


#: the packages from the bottom up; a package imports only packages of a lower layer, so the apps
#: (one layer: neither imports the other) sit on the methods, the methods on the engine, which knows
#: no method, and both on the neutral pieces both halves use (common: config, data, training loops,
#: the payload and metric protocol; models); the attacks of the privacy evaluation (privacy) sit
#: beside the engine and import neither it nor a method
LAYERS = (
    ("models",),
    ("common",),
    ("engine", "privacy"),
    ("methods",),
    ("client_app", "server_app"),
    ("tools",),
    ("bench",),
)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of ``graph`` from a package into one of the same or a higher
    layer of :data:`LAYERS` (imports inside one package are free)."""
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if a.split(".")[0] != b.split(".")[0] and layer[b.split(".")[0]] >= layer[a.split(".")[0]]
    )


def test_layer_checker_finds_planted_upward_and_sideways_imports():
    graph = {"common.data": {"engine.contract", "models.base"}, "client_app.app": {"server_app.app", "common.data"}}
    assert upward_imports(graph) == ["client_app.app -> server_app.app", "common.data -> engine.contract"]


def test_packages_import_only_lower_layers():
    assert {pkg for pkgs in LAYERS for pkg in pkgs} == set(PACKAGES)
    assert upward_imports(import_graph()) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` found by depth-first search, each as the modules along it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "common.config" in graph and "common.data" in graph  # the walk saw the tree
    assert cycles(graph) == []


def test_the_roster_and_the_transport_meet_only_in_the_federation():
    """``engine.federation.Federation`` wires them: neither imports the other, and a method's server half
    reaches its clients through the federation it is handed, never through the roster, the transport or the
    runner."""
    graph = import_graph()
    assert "engine.transport" not in graph["engine.roster"] and "engine.roster" not in graph["engine.transport"]
    assert {"engine.roster", "engine.transport"} <= graph["engine.federation"]
    method_modules = [m for m in graph if m.startswith("methods.") and m != "methods.registry"]
    assert len(method_modules) > 11
    reached = {b for a in method_modules for b in graph[a]}
    assert not reached & {"engine.roster", "engine.transport", "engine.runner", "engine.federation"}


def test_no_method_imports_another_method():
    from methods.registry import METHODS

    method_modules = {m.server.__module__ for m in METHODS.values()} | {m.client.__module__ for m in METHODS.values()}
    assert len(method_modules) == 14  # the variants of MH-pFedHN and of FedL2G share a module
    graph = import_graph()
    borrowed = {(a, b) for a in method_modules for b in graph[a] if b in method_modules}
    assert borrowed == set()


def test_every_method_has_its_page_and_code_cites_no_outside_document():
    from methods.registry import METHODS

    readme = (ROOT / "README.md").read_text()
    for name, method in METHODS.items():
        # one page a module (the variants of MH-pFedHN and of FedL2G share theirs), named as the module
        module = method.server.__module__.rsplit(".", 1)[-1]
        page = ROOT / "docs" / "methods" / f"{module.replace('_', '-')}.md"
        assert page.is_file(), name
        assert "Payload" in page.read_text(), name  # every page gives the payload both ways
        assert f"| `{name}` |" in readme, name  # and a line in the README's method table
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            assert "shared/specs" not in text and "spec section" not in text, path


def test_the_client_app_takes_only_the_method_table_from_the_server_side_package():
    """The wire protocol (config keys, train settings, metric values, state names) lives in
    ``common.protocol``; of the engine and the methods the ClientApp's handlers need only the method table (which
    procedure answers which message), and the module Flower loads needs nothing of it."""
    graph = import_graph()
    assert {b for b in graph["client_app.handlers"] if b.startswith(("engine", "methods"))} == {"methods.registry"}
    assert not {b for b in graph["client_app.app"] if b.startswith(("engine", "methods"))}


def test_the_module_flower_loads_before_ray_imports_neither_torch_nor_the_methods():
    """flwr-simulation loads the ClientApp before it starts Ray: what ``client_app.app`` imports delays
    Ray's start. Its handlers serve every message type some method sends, and no other."""
    code = "import sys, client_app.app; print(sorted(m for m in ('torch', 'methods.registry') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from client_app.app import app
    from common.protocol import MESSAGE_TYPES
    from methods.registry import METHODS, unserved_message_types

    assert set(MESSAGE_TYPES) == {t for m in METHODS.values() for t in m.message_types}
    assert set(app._registered_funcs) == {t if "." in t else f"{t}.default" for t in MESSAGE_TYPES}
    other = SimpleNamespace(message_types=("train", "train.secret"))
    assert unserved_message_types({**METHODS, "other": other}) == ["other: train.secret"]
