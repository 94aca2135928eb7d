"""The package's import graph: every `import` / `from ... import` inside dspark/ (at module level or deferred
inside a function) is an edge from the importing module to the dspark module it names. The graph has no cycles
(its strongly connected components are single modules), and it keeps the package layers of docs/structure.md:
a module imports its own layer and the layers below, never one above.

    pytest tests/test_import_graph.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The dspark module `name` lives in (a module, or the package whose attribute it is)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            else:
                continue
            deps |= {r for r in (_resolve(n, modules) for n in names) if r and r != module}
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                if len(component) > 1:
                    out.append(sorted(component))
    return out


# The layers, from the bottom up (a top-level module or package of dspark/ each, or a module inside a package
# placed apart from it; "dspark" is the package's __init__, the public API).
LAYERS = (
    ("utils", "kernels", "config", "spec_schema", "sampling", "logits_processors", "request", "structured", "json_schema",
     "detokenizer", "generation_config", "engine_args",
     "drafters.methods"),  # configuration, requests, sampling, CPU kernels; the drafter-method records config reads
    ("models",),  # target families, loading, attention, recurrent state
    ("verify", "drafters", "chat"),  # the verifier; the drafters; chat output parsing
    ("worker", "distributed"),  # the model runner and CUDA graphs; tensor-parallel ranks
    ("speculation",),  # speculation control
    ("engine",),  # scheduler, block manager, the step, building an engine
    ("llm", "server", "train", "bench", "parity", "cli", "cli_generate", "cli_profile", "__main__", "dspark"),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _part(module: str) -> str:
    """The LAYERS entry `module` falls under: itself where listed (`drafters.methods`), else its top-level part."""
    parts = module.split(".")
    if ".".join(parts[1:]) in LAYER_OF:
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) edges that go to a higher layer; a module of no layer is one too."""
    out = []
    for module, deps in graph.items():
        here = LAYER_OF.get(_part(module))
        for dep in deps:
            there = LAYER_OF.get(_part(dep))
            if here is None or there is None or there > here:
                out.append((module, dep))
    return sorted(out)


def test_every_package_keeps_its_layer():
    found = upward_imports(import_graph())
    assert not found, "imports from a lower layer to a higher one (tests/test_import_graph.py LAYERS):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in found)


def test_an_upward_import_is_caught():
    graph = import_graph()
    assert not upward_imports(graph)
    graph["dspark.models.llama"] = graph["dspark.models.llama"] | {"dspark.engine.engine"}
    assert upward_imports(graph) == [("dspark.models.llama", "dspark.engine.engine")]
    assert upward_imports({"dspark.newpackage.x": set()}) == [] and \
        upward_imports({"dspark.newpackage.x": {"dspark.config"}}) == [("dspark.newpackage.x", "dspark.config")]


# Edges no layer rule forbids on its own terms: (importing package, imported module). The speculation controller
# takes the committed step as values and hands drafts back; it never reaches into the engine's scheduler or
# block manager.
FORBIDDEN = (
    ("dspark.speculation", "dspark.engine.scheduler"),
    ("dspark.speculation", "dspark.engine.block_manager"),
    ("dspark.speculation", "dspark.engine.engine"),
)


def forbidden_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, dep) for module, deps in graph.items() for dep in deps
                  for importer, imported in FORBIDDEN
                  if (module == importer or module.startswith(importer + ".")) and dep == imported)


def test_speculation_never_imports_the_scheduler_or_block_manager():
    found = forbidden_imports(import_graph())
    assert not found, "speculation reaches into the engine (tests/test_import_graph.py FORBIDDEN):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in found)


def test_a_back_call_import_is_caught():
    graph = import_graph()
    graph["dspark.speculation.controller"] = graph["dspark.speculation.controller"] | {"dspark.engine.scheduler"}
    assert forbidden_imports(graph) == [("dspark.speculation.controller", "dspark.engine.scheduler")]
    assert ("dspark.speculation.controller", "dspark.engine.scheduler") in upward_imports(graph)


def test_the_controller_is_handed_no_engine_object():
    """Built whole from the configuration, the drafter, its policy and table, and the metrics sink: no
    scheduler, block manager or registry of the engine's requests to call back into."""
    import inspect

    from dspark.speculation.controller import SpecController, build_controller
    for f in (build_controller, SpecController.__init__):
        names = set(inspect.signature(f).parameters)
        assert not names & {"scheduler", "block_manager", "requests", "engine"}, (f.__qualname__, names)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "dspark.engine.step_profiler" in graph["dspark.engine.engine"]  # imported inside a function
    assert len(graph) > 50


def test_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles in dspark/: {found}"
