"""met's packages import only the packages below them (/work/shared/DESIGN.md, "Layers"), and
no modules import each other in a cycle.

Every ``import`` of every met/**/*.py file counts: at module level, inside functions and
under ``if TYPE_CHECKING:`` alike (a type-only upward import still couples a lower package
to a higher one). A new package, or a new edge between packages, goes into `ALLOWED` here,
and only downward in `ORDER`.
"""

from __future__ import annotations

import ast
from pathlib import Path

MET = Path(__file__).resolve().parents[1] / "met"  # read, never imported

# Top to bottom. "met" is the package's own __init__ (the public facade: LLM, SamplingParams,
# __version__); every other name is a subpackage or a top-level module of met/.
ORDER = ("__main__", "cli", "bench", "api", "met", "llm", "serving", "engine", "scheduler", "spec",
         "cache", "runner", "loader", "lora", "models", "layers", "sampling", "outputs", "config",
         "kernels")

# Which other packages each may import (imports within a package are always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "__main__": frozenset({"cli"}),
    "cli": frozenset({"bench", "api", "met", "serving", "engine", "loader", "sampling",
                      "kernels", "outputs", "config"}),
    # A client of the HTTP server: none of the engine; the loader only to read the served
    # model's config (lora-mix writes adapters of its shapes).
    "bench": frozenset({"loader"}),
    "api": frozenset({"met", "serving", "engine", "sampling", "outputs", "config"}),
    "met": frozenset({"llm", "engine", "sampling", "outputs"}),
    # The offline LLM: the server's own request handling (templates, tools, stops, best_of)
    # over a synchronous EngineCore, so offline and HTTP share one implementation.
    "llm": frozenset({"serving", "engine", "cache", "sampling", "outputs", "config"}),
    "serving": frozenset({"engine", "sampling", "outputs", "config"}),
    "engine": frozenset({"scheduler", "spec", "cache", "runner", "loader", "lora", "models",
                         "sampling",
                         "kernels", "outputs", "config"}),
    # The scheduler fills the runner's plain step data (met.runner.batch_plan).
    "scheduler": frozenset({"cache", "runner", "sampling", "config"}),
    # Proposers and the throughput gate; the engine core runs verification.
    "spec": frozenset({"config"}),
    "cache": frozenset({"config"}),
    "runner": frozenset({"models", "layers", "sampling", "kernels", "config"}),
    "loader": frozenset({"models", "layers", "kernels", "config"}),  # builds the models
    # Adapters: read PEFT files, hold the slots in the model's projections.
    "lora": frozenset({"layers", "kernels", "config"}),
    "models": frozenset({"layers", "kernels", "config"}),
    "layers": frozenset({"kernels", "config"}),
    "sampling": frozenset({"kernels", "config"}),  # the native sampler ops
    "outputs": frozenset(),
    "config": frozenset({"kernels"}),  # checks --linear/attention-backend against registries
    "kernels": frozenset(),  # nothing above knows an ISA; it knows nothing above
}


def _files() -> list[Path]:
    return sorted(MET.rglob("*.py"))


def _module(path: Path) -> str:
    parts = ["met", *path.relative_to(MET).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """met → "met"; met.cli → "cli"; met.engine.core → "engine"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "met"


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, the statement as written) for each met import in the file,
    wherever it sits (functions and TYPE_CHECKING blocks included)."""
    module = _module(path)
    is_init = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                if not is_init:
                    package = package[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names = ", ".join(a.name for a in node.names)
            written = f"from {'.' * node.level}{node.module or ''} import {names}"
            for alias in node.names:  # `from met.layers import layer_stack`: the submodule
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if _is_module(full) else base, written))
    return [(line, name, text) for line, name, text in out
            if name == "met" or name.startswith("met.")]


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (MET / rel).with_suffix(".py").is_file() or (MET / rel / "__init__.py").is_file()


def test_the_allowed_edges_point_down_the_order():
    assert set(ALLOWED) == set(ORDER)
    rank = {name: i for i, name in enumerate(ORDER)}
    upward = [f"{pkg} -> {dep}" for pkg, deps in ALLOWED.items() for dep in deps
              if rank[dep] <= rank[pkg]]
    assert not upward, f"ALLOWED has edges that do not point down ORDER: {upward}"


def test_every_package_is_placed():
    found = {_package(_module(path)) for path in _files()}
    unplaced = sorted(found - set(ORDER))
    assert not unplaced, (f"met packages/modules {unplaced} are not in tests/test_layering.py's "
                          f"ORDER and ALLOWED: place them")


def test_no_package_imports_one_above_it():
    violations = []
    for path in _files():
        pkg = _package(_module(path))
        for line, name, text in _imports(path):
            dep = _package(name)
            message = (f"{path.relative_to(MET.parent)}:{line}: {text!r} "
                       f"({pkg} may not import {dep})")
            if (dep != pkg and dep not in ALLOWED.get(pkg, frozenset())
                    and message not in violations):
                violations.append(message)
    assert not violations, "upward or unlisted imports:\n" + "\n".join(violations)


def test_no_modules_import_each_other_in_a_cycle():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for path in _files():
        module = _module(path)
        edges = graph.setdefault(module, set())
        for line, name, _ in _imports(path):
            while name != "met" and not _is_module(name):  # `from met.x import Name`
                name = name.rpartition(".")[0]
            if name != module:
                edges.add(name)
                where.setdefault((module, name), f"{path.relative_to(MET.parent)}:{line}")
    cycles = [cycle for cycle in _strong_components(graph) if len(cycle) > 1]
    described = []
    for cycle in cycles:
        members = set(cycle)
        described.append("; ".join(f"{where[(a, b)]} imports {b}" for a in sorted(cycle)
                                   for b in sorted(graph[a] & members)))
    assert not cycles, "import cycles:\n" + "\n".join(described)


def _strong_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out
