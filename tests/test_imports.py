"""The import graph of generation/ and deployments/, read from the source with `ast` (nothing is
imported): every import counts, at the top of a module or lazily inside a function.

Invariants: no cycle among the project's modules; serving never touches arrays (no module of
deployments/ imports numpy); the engine never imports the serving layer; the default model's
training and export (torch, transformers) are imported by nothing outside generation.default_model;
serving asks a model's family (generation.families) what it is, and never reads the sessions or the
config fields that tell the families apart.

Within generation/, the sub-packages point one way (LAYERS, bottom first; tasks.py, cli.py and
__init__.py above them all): no cycle among them; no layer below the families imports a family
module, reads a model's `family` or compares a value to a family's name (a family gives what it
adds through the hooks the loaded Model carries: generation/runtime/hooks.py); no private name
(`_x`) is imported from another sub-package.
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


def import_lines(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module named, names taken from it) for every import statement in `module`'s source,
    relative imports resolved: `import a.b` is ("a.b", []), `from . import c` in package p is
    ("p", ["c"])."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base, [alias.name for alias in node.names]))
    return found


def imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """`import_lines` without the lines."""
    return [(base, names) for _, base, names in import_lines(module, path)]


def targets(base: str, names: list[str], modules) -> list[str]:
    """The modules an import points at: `from p import c` at p.c where that is a module, else at p."""
    return [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports. `from p import c` points at p.c where that is a
    module, else at p. A package's __init__ run only as the parent of a submodule imported is not
    an edge: Python initialises it before the submodule, whatever that one imports."""
    graph = {}
    for module, path in modules.items():
        edges = set()
        for base, names in imports(module, path):
            for target in targets(base, names, modules):
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
    assert "generation.params.settings" in graph["generation.core.context"]  # a top-level relative import
    assert "generation.runtime.model" in graph["generation.core.context"]  # and a lazy one, inside a function
    assert {"generation.core.warm", "generation.core.state"} <= graph["generation"]  # a package's __init__
    assert "generation.assisted.verify" in graph["generation.engine.batching"]  # `from generation.assisted import verify`


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


# generation's sub-packages, bottom first: each imports only those before it (generation.front is
# the engine's front, above the families; default_model, the bundled model, reads the runtime)
LAYERS = ("runtime", "params", "cache", "logits", "text", "search", "core", "assisted", "engine", "families",
          "front", "default_model")
# the layers that never name a family: every one below generation.families
BELOW_FAMILIES = LAYERS[:LAYERS.index("families")]


def layer(module: str, modules: dict[str, Path]) -> str:
    """The part of generation a module belongs to: its sub-package ("generation.core"), or itself
    for a module at the top (generation, generation.tasks, generation.cli)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and modules.get(module, Path()).name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def layer_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[str]]]:
    """generation's sub-packages (and its top-level modules) -> those they import -> where
    ("generation/core/state.py:30"), from every import of their modules, lazy ones too. As
    import_graph, an import points at the module it names (a package's __init__ run as the parent
    of a submodule is no edge)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        if not module.startswith("generation"):
            continue
        here = layer(module, modules)
        for line, base, names in import_lines(module, path):
            for target in targets(base, names, modules):
                if target in modules and target.startswith("generation") and layer(target, modules) != here:
                    where = f"{path.relative_to(ROOT)}:{line}" if path.is_relative_to(ROOT) else f"{path}:{line}"
                    sites = graph.setdefault(here, {}).setdefault(layer(target, modules), [])
                    if where not in sites:
                        sites.append(where)
    return graph


def layer_cycles(modules: dict[str, Path]) -> list[str]:
    """Each cycle among generation's sub-packages, its edges named by the imports that make them."""
    graph = layer_graph(modules)
    found = []
    for cycle in cycles({a: set(b) for a, b in graph.items()}):
        edges = [f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:])]
        found.append(" -> ".join(cycle) + "\n" + "\n".join(edges))
    return found


def family_names() -> tuple[str, ...]:
    """generation.families.FAMILIES, read from its source, but "seq2seq": also the name of the
    encoder-decoder cache mode, which the layers below may compare with."""
    tree = ast.parse((ROOT / "generation" / "families" / "__init__.py").read_text())
    value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "FAMILIES" for t in node.targets))
    return tuple(name for name in ast.literal_eval(value) if name != "seq2seq")


def family_mentions(module: str, path: Path, names: tuple[str, ...]) -> list[str]:
    """Where a module names a family: an import of generation.families, a read of a model's
    `family`, a comparison with a family's name ("whisper")."""
    found = [f"{path.name}:{line} imports {base}" for line, base, _ in import_lines(module, path)
             if base == "generation.families" or base.startswith("generation.families.")]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "family":
            found.append(f"{path.name}:{node.lineno} reads .family")
        elif isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                for leaf in ast.walk(part):
                    if isinstance(leaf, ast.Constant) and leaf.value in names:
                        found.append(f"{path.name}:{node.lineno} compares with {leaf.value!r}")
    return found


def private_imports(modules: dict[str, Path]) -> list[str]:
    """Each private name (`_x`, or a module path through one) a generation module imports from
    another of generation's sub-packages, with where."""
    found = []
    for module, path in modules.items():
        if not module.startswith("generation"):
            continue
        for line, base, names in import_lines(module, path):
            if not base.startswith("generation") or base not in modules and base.rpartition(".")[0] not in modules:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [part for part in base.split(".") if part.startswith("_") and not part.startswith("__")]
            if private and layer(base, modules) != layer(module, modules):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} "
                             f"imports {', '.join(private)} from {base}")
    return found


def test_generations_sub_packages_import_each_other_one_way():
    found = layer_cycles(module_files())
    assert not found, "cycles among generation's sub-packages:\n" + "\n".join(found)


def test_every_import_between_sub_packages_points_down_the_layers():
    modules = module_files()
    rank = {f"generation.{name}": i for i, name in enumerate(LAYERS)}
    assert set(rank) >= {layer(m, modules) for m in modules if m.startswith("generation.")} - {
        "generation.tasks", "generation.cli"}, "a new sub-package: give it its place in LAYERS"
    upward = [f"{a} -> {b}: {', '.join(where)}" for a, edges in layer_graph(modules).items() for b, where in edges.items()
              if a in rank and b in rank and rank[b] > rank[a]]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_no_layer_below_the_families_names_a_family():
    modules = module_files()
    names = family_names()
    assert {"whisper", "qwen2_vl", "idefics3"} <= set(names)
    found = [mention for module, path in modules.items() if layer(module, modules) in
             {f"generation.{name}" for name in BELOW_FAMILIES} for mention in family_mentions(module, path, names)]
    assert not found, "families named below generation.families:\n" + "\n".join(found)


def test_no_private_name_crosses_sub_packages():
    found = private_imports(module_files())
    assert not found, "private names imported from another sub-package:\n" + "\n".join(found)


def test_the_layer_checks_see_cycles_families_and_private_names(tmp_path):
    files = {
        "generation/__init__.py": "",
        "generation/core/__init__.py": "",
        "generation/core/state.py": "from ..families.whisper import HOOKS\n"
                                    "def f(model):\n    return model.family == 'whisper'\n",
        "generation/logits/__init__.py": "",
        "generation/logits/rows.py": "def g():\n    from ..core.state import _ends\n",
        "generation/families/__init__.py": "FAMILIES = ('whisper', 'seq2seq', 'text')\n",
        "generation/families/whisper.py": "from ..logits.rows import g\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {}
    for path in sorted((tmp_path / "generation").rglob("*.py")):
        parts = path.relative_to(tmp_path).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    cycle = layer_cycles(modules)
    assert len(cycle) == 1 and cycle[0].startswith("generation.core -> generation.families -> generation.logits -> "
                                                   "generation.core\n")
    assert "state.py:1" in cycle[0] and "rows.py:2" in cycle[0] and "whisper.py:1" in cycle[0]
    state = modules["generation.core.state"]
    assert sorted(family_mentions("generation.core.state", state, ("whisper", "text"))) == [
        "state.py:1 imports generation.families.whisper", "state.py:3 compares with 'whisper'",
        "state.py:3 reads .family"]
    assert private_imports(modules) == [f"{modules['generation.logits.rows']}:2 imports _ends from generation.core.state"]


# -- serving reaches the engine through its front --------------------------------------------------
# The engine modules deployments/ may import: generation's own face, the engine front's, the command
# line's version and commands, and the default model's folder.
ENGINE_DOORS = ("generation", "generation.front", "generation.cli", "generation.default_model")


def engine_modules_of_serving(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Each generation module deployments/ imports -> where ("deployments.app:12")."""
    found: dict[str, list[str]] = {}
    for module, path in modules.items():
        if not module.startswith("deployments"):
            continue
        for line, base, names in import_lines(module, path):
            for target in targets(base, names, modules):
                if target.split(".")[0] == "generation":
                    found.setdefault(target, []).append(f"{module}:{line}")
    return found


def test_serving_reaches_the_engine_through_its_front():
    found = engine_modules_of_serving(module_files())
    others = {module: where for module, where in found.items() if module not in ENGINE_DOORS}
    assert not others, f"deployments/ reaches past the engine front: {others}"
    assert len(found) <= 4


def test_the_door_check_sees_a_module_past_the_front(tmp_path):
    (tmp_path / "deployments").mkdir()
    (tmp_path / "deployments" / "__init__.py").write_text("")
    (tmp_path / "deployments" / "x.py").write_text("def f():\n    from generation.core.state import step\n")
    (tmp_path / "generation" / "core").mkdir(parents=True)
    for name in ("generation/__init__.py", "generation/core/__init__.py", "generation/core/state.py"):
        (tmp_path / name).write_text("")
    modules = {"deployments": tmp_path / "deployments/__init__.py", "deployments.x": tmp_path / "deployments/x.py",
               "generation": tmp_path / "generation/__init__.py", "generation.core": tmp_path / "generation/core/__init__.py",
               "generation.core.state": tmp_path / "generation/core/state.py"}
    assert engine_modules_of_serving(modules) == {"generation.core.state": ["deployments.x:2"]}
