"""The package's import graph: no circle between modules or packages, and every layer imports only downwards.

Every ``import`` counts, at module level or inside a function (a lazy import is still a dependency); imports
under ``if TYPE_CHECKING:`` are annotations only and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "polyrl"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("polyrl")}


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _package(module: str) -> str:
    """The room a module lives in: polyrl.<first part> (a subpackage, or a top-level module)."""
    return ".".join(module.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_between_modules():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle
    graph = {m: {d for d in deps if not (m == _package(m) and d.startswith(m + "."))} for m, deps in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_circle_between_packages():
    rooms: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        rooms.setdefault(_package(module), set()).update(_package(d) for d in deps if _package(d) != _package(module))
    assert _cycle(rooms) is None, " -> ".join(_cycle(rooms))


@pytest.mark.parametrize("low,forbidden", [
    ("polyrl.objectives", {"polyrl.rollout", "polyrl.tasks", "polyrl.learner", "polyrl.trainer", "polyrl.build",
                           "polyrl.cli", "polyrl.lab", "polyrl.model", "polyrl.update"}),
    ("polyrl.rollout", {"polyrl.trainer", "polyrl.build", "polyrl.cli", "polyrl.lab", "polyrl.learner"}),
    ("polyrl.tasks", {"polyrl.trainer", "polyrl.build", "polyrl.cli", "polyrl.lab", "polyrl.rollout"}),
    ("polyrl.learner", {"polyrl.trainer", "polyrl.build", "polyrl.cli", "polyrl.lab"}),
    ("polyrl.model", {"polyrl.trainer", "polyrl.build", "polyrl.cli", "polyrl.lab"}),
    ("polyrl.guard", {"polyrl.lab", "polyrl.config", "polyrl.cli"}),
    ("polyrl.lab", {"polyrl.cli"}),
    ("polyrl.build", {"polyrl.trainer", "polyrl.cli"}),
    ("polyrl.combinations", {"polyrl.build", "polyrl.trainer", "polyrl.cli", "polyrl.lab"}),
])
def test_layers_import_only_downwards(low, forbidden):
    bad = {(m, d) for m, deps in _graph().items() if m == low or m.startswith(low + ".")
           for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden)}
    assert not bad, sorted(bad)


def test_the_loop_branches_on_no_sampler_pipeline_agency_or_backend():
    source = (ROOT / "trainer.py").read_text()
    assert len(source.splitlines()) <= 300
    words = ("tree", "sampler", "pipeline", "async", "prefetch", "agency", "arbiter", "critic", "reference", "backend",
             "generator", "kl_placement", "needs_", "worker", "ray", "rank", "world", "fsdp", "dist")
    tests = [ast.unparse(node.test) for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.If, ast.IfExp))]
    assert not [t for t in tests if any(w in t.lower() for w in words)], tests
    concrete = {"polyrl.rollout.tree", "polyrl.rollout.group", "polyrl.rollout.remote", "polyrl.rollout.agency",
                "polyrl.rollout.hf", "polyrl.learner"}
    assert not {m for m in _imports(ROOT / "trainer.py") if any(m.startswith(c) for c in concrete)}
