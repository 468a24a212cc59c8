"""The import graph of generation/ and deployments/, read from the source with `ast` (nothing is
imported): every import counts, at the top of a module or lazily inside a function.

Invariants: no cycle among the project's modules; serving never touches arrays (no module of
deployments/ imports numpy); the engine never imports the serving layer; the default model's
training and export (torch, transformers) are imported by nothing outside generation.default_model;
serving asks a model's family (generation.families) what it is, and never reads the sessions or the
config fields that tell the families apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("generation", "deployments")

# (module, reason) pairs allowed to remain: none
KNOWN: set = set()
# generation.default_model's modules that only its commands run
OFFLINE = ("train", "export")
# what tells the families apart: a loaded model's sessions and config.json's fields (serving asks
# generation.families instead)
FAMILY_INTERNALS = {"vision_session", "embed_session", "first_step_session", "is_encoder_decoder", "model_type"}


def family_internals(path: Path) -> set[str]:
    """The FAMILY_INTERNALS a module reads: as attributes, or as string constants (config keys)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in FAMILY_INTERNALS:
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FAMILY_INTERNALS:
            found.add(node.value)
    return found


def module_files() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package's __init__ under the package's name)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module named, names taken from it) for every import statement in `module`'s source, relative
    imports resolved: `import a.b` is ("a.b", []), `from . import c` in package p is ("p", ["c"])."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. `from p import c` points at p.c where that is a
    module, else at p. A package's __init__ run only as the parent of a submodule imported is not
    an edge: Python initialises it before the submodule, whatever that one imports."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for base, names in imports(module, path):
            for target in [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]:
                if target in modules and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def imports_package(module: str, path: Path, package: str) -> bool:
    """Whether `module` imports `package` or any module of it, anywhere in its source."""
    return any(base == package or base.startswith(package + ".") for base, _ in imports(module, path))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None: a depth-first search that meets a module
    still on its path. Deterministic (sorted), so a failure names the same cycle every run."""
    done, path, on_path = set(), [], set()

    def visit(node):
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph`, one at a time: each found is broken at the edge that closed it and
    the search runs again, so a failure lists every cycle, not only the first."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while (cycle := find_cycle(graph)) is not None:
        found.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])  # the edge that closed it
    return found


def violations(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, reason) for each cycle (named by its first module), each deployments/ module that
    imports numpy, each generation/ module that imports deployments, and each module outside
    generation.default_model that imports its training or export."""
    graph = import_graph(modules)
    found = {(cycle[0], "in cycle " + " -> ".join(cycle)) for cycle in cycles(graph)}
    for module, path in modules.items():
        package = module.partition(".")[0]
        if package == "deployments" and imports_package(module, path, "numpy"):
            found.add((module, "imports numpy"))
        if package == "deployments" and family_internals(path):
            found.add((module, "reads " + ", ".join(sorted(family_internals(path)))))
        if package == "generation" and imports_package(module, path, "deployments"):
            found.add((module, "imports deployments"))
        offline = {f"generation.default_model.{m}" for m in OFFLINE}
        named = {f"{base}.{n}" for base, names in imports(module, path) for n in names} | {
            base for base, _ in imports(module, path)}
        if not module.startswith("generation.default_model") and named & offline:
            found.add((module, "imports the default model's training or export"))
    return found


def test_the_violations_are_exactly_the_known_ones():
    found = violations(module_files())
    assert found - KNOWN == set(), f"new violations: {sorted(found - KNOWN)}"
    assert KNOWN - found == set(), f"fixed, remove from KNOWN: {sorted(KNOWN - found)}"


def test_every_module_is_read():
    modules = module_files()
    assert {"generation", "generation.core.context", "deployments", "deployments.app"} <= set(modules)
    graph = import_graph(modules)
    assert "generation.core.settings" in graph["generation.core.context"]  # a top-level relative import
    assert "generation.runtime.model" in graph["generation.core.context"]  # and a lazy one, inside a function
    assert {"generation.core.warm", "generation.core.state"} <= graph["generation"]  # a package's __init__
    assert "generation.core.limits" in graph["deployments.http.openai"]  # `from generation import limits`


def test_the_cycle_finder_finds_a_hand_made_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert len(cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == 2


def test_the_checks_see_numpy_deployments_and_lazy_cycles(tmp_path):
    (tmp_path / "deployments").mkdir()
    (tmp_path / "generation").mkdir()
    (tmp_path / "deployments" / "x.py").write_text("def f():\n    import numpy.linalg\n")
    (tmp_path / "deployments" / "u.py").write_text("def k(model):\n    return model.config.get('model_type')\n")
    (tmp_path / "generation" / "y.py").write_text("from deployments.x import f\n")
    (tmp_path / "generation" / "z.py").write_text("def g():\n    from . import w\n")
    (tmp_path / "generation" / "w.py").write_text("from .z import g\n")
    (tmp_path / "generation" / "v.py").write_text("def h():\n    from .default_model import train\n")
    modules = {"deployments.x": tmp_path / "deployments" / "x.py", "deployments.u": tmp_path / "deployments" / "u.py",
               "generation.y": tmp_path / "generation" / "y.py",
               "generation.z": tmp_path / "generation" / "z.py", "generation.w": tmp_path / "generation" / "w.py",
               "generation.v": tmp_path / "generation" / "v.py"}
    assert violations(modules) == {("deployments.x", "imports numpy"), ("generation.y", "imports deployments"),
                                   ("deployments.u", "reads model_type"),
                                   ("generation.w", "in cycle generation.w -> generation.z -> generation.w"),
                                   ("generation.v", "imports the default model's training or export")}
