"""No import cycle between zeroray's modules, TYPE_CHECKING imports included: a cycle means an
interface is defined by the concrete class on the other side. Imports inside functions are lazy on
purpose (``import zeroray`` never imports Ray) and are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

import zeroray

ROOT = Path(zeroray.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _top_level_imports(body: list[ast.stmt], typing: bool = True) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: at its top level and in top-level if/try blocks, not in
    functions or classes; ``if TYPE_CHECKING:`` blocks only when ``typing``."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if typing or not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                out += _top_level_imports(node.body, typing)
            out += _top_level_imports(node.orelse, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out += _top_level_imports(block, typing)
    return out


def import_graph(typing: bool = True) -> dict[str, set[str]]:
    """Module -> the zeroray modules it imports (``from a.b import c`` counts ``a.b.c`` if it is a
    module, else ``a.b``; a package's own ``__init__`` is not an edge of its submodules). ``typing``:
    count the imports under ``if TYPE_CHECKING:`` (False: only what importing the module runs)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text()).body, typing):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "zeroray.engine.sub_groups" in graph["zeroray.engine.offload.home"]  # the graph sees real edges
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = import_graph()
    graph["zeroray.engine.flat_group"].add("zeroray.engine.offload.param_files")  # the cycle ShardFiles broke
    assert ["zeroray.engine.flat_group", "zeroray.engine.offload.param_files"] in cycles(graph)


def test_the_engine_imports_nothing_from_ray_or_the_layers_above_it() -> None:
    graph = import_graph()
    for name, path in _modules().items():
        if name.startswith("zeroray.engine"):
            above = [d for d in graph[name] if d.startswith(("zeroray.train", "zeroray.checkpoint", "zeroray.monitoring"))]
            assert above == [], name
            tree = ast.parse(path.read_text())
            ray = [n for n in ast.walk(tree) if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ray" for a in n.names)
                   or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ray"]
            assert ray == [], name


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


_LOOP, _DRIVER, _GROUP = "zeroray.train.worker", "zeroray.train.driver", "zeroray.train.group"


def layer_problems(graph: dict[str, set[str]]) -> list[str]:
    """driver/ runs in the process that called fit(), worker/ inside the user's loop in a rank, group/
    between them (the actors). Importing a driver or group module loads no loop code (the rank actor
    imports it in the methods that run in the actor); the loop loads neither the driver nor the group;
    the shared modules of train/ (not the package's ``__init__`` nor the trainer, the driver's entry)
    load none of the three. ``graph``: the imports that run (no ``TYPE_CHECKING`` blocks)."""
    problems = []
    for name in graph:
        reach = _closure(graph, name)
        if name.startswith((_DRIVER, _GROUP)):
            problems += [f"{name} -> {d}" for d in reach if d.startswith(_LOOP)]
        elif name.startswith(_LOOP):
            problems += [f"{name} -> {d}" for d in reach if d.startswith((_DRIVER, _GROUP))]
        elif name.startswith("zeroray.train.") and name != "zeroray.train.trainer":
            problems += [f"{name} -> {d}" for d in reach if d.startswith((_LOOP, _DRIVER, _GROUP))]
    return sorted(problems)


def test_the_driver_never_imports_the_loop_and_the_loop_never_imports_the_driver() -> None:
    graph = import_graph(typing=False)
    assert f"{_GROUP}.worker_group" in graph[f"{_DRIVER}.controller"]  # the graph sees the layers' real edges
    assert layer_problems(graph) == []


def test_the_layer_check_finds_a_driver_import_in_the_loop_and_a_loop_import_in_the_driver() -> None:
    graph = import_graph(typing=False)
    graph[f"{_LOOP}.reporting"].add(f"{_DRIVER}.progress")
    graph[f"{_GROUP}.rank_actor"].add(f"{_LOOP}.recovery")
    problems = layer_problems(graph)
    assert f"{_LOOP}.reporting -> {_DRIVER}.progress" in problems
    assert f"{_DRIVER}.controller -> {_LOOP}.recovery" in problems  # through the group


_ENGINE_API = {"zeroray.engine", "zeroray.engine.layout", "zeroray.engine.shard_state", "zeroray.engine.comm"}


def test_the_layers_above_the_engine_use_only_its_exported_modules() -> None:
    """checkpoint/, train/ and the rest reach the engine through ``zeroray.engine``'s names, its partition
    arithmetic (``layout``), the checkpoint protocol's types (``shard_state``) and ``Comm``: never its
    internals, lazy imports included."""
    found = []
    for name, path in _modules().items():
        if name.startswith("zeroray.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name} -> {t}" for t in targets if t.startswith("zeroray.engine") and t not in _ENGINE_API]
    assert found == []
