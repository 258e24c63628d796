"""The package's layers, held over the real import graph: every import a module makes (at the
top, inside a function, under `if TYPE_CHECKING:`) counts.

- Each subpackage imports only the layers below it (ALLOWED), and the decision side
  (records, config, core) and the kernel and observe layers never reach os-ken, not even
  through a module they import (Faucet's rule: the logic runs without a switch).
- No import cycle at all between modules.
- No class over 320 lines, no function over 60, the os-ken app's module under 250 lines.
"""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "nfshunt")
TOP = "top"  # cli, probe, iptables, __main__: the commands, above every layer

# What each layer may import (besides itself), lowest first. docs/architecture.md draws it.
ALLOWED: dict[str, set[str]] = {
    "records": set(),
    "config": {"records"},
    "kernel": {"records"},
    "core": {"records", "config"},
    "observe": {"records", "config", "core"},
    "openflow": {"records", "config", "core", "kernel", "observe"},
    "switch": {"records", "config", "core", "kernel", "observe", "openflow"},
    "ids": {"records", "config", "core", "kernel", "observe", "openflow", "switch"},
    "app": {"records", "config", "core", "kernel", "observe", "openflow", "switch", "ids"},
    TOP: {"records", "config", "core", "kernel", "observe", "openflow", "switch", "ids", "app"},
}
NO_OS_KEN = ("records", "config", "core", "kernel", "observe")
MAX_CLASS, MAX_FUNCTION, MAX_APP = 320, 60, 250
IDS_SERVER = "nfshunt.ids.api"  # the HTTP server: only the API's process (and the app) start it
IDS_SERVER_USERS = {"nfshunt.ids.process"}
APP_MODULE = "nfshunt.app.switch_app"


def _modules() -> dict[str, str]:
    """Every module of the package by dotted name, with its file."""
    found = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(root, f)
    return found


def _imports(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules and the outside top-level packages a module's code names in an
    import, wherever the import stands."""
    here = name if is_package else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names if f"{mod}.{alias.name}" in modules)
    out = set()
    for mod in found:
        if mod in modules:
            out.add(mod)
        elif mod.startswith("nfshunt."):  # a name taken from a module: the module
            while mod and mod not in modules:
                mod = mod.rpartition(".")[0]
            if mod:
                out.add(mod)
        else:
            out.add(mod.split(".")[0])
    return out - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        with open(path) as fh:
            graph[name] = _imports(ast.parse(fh.read()), name, path.endswith("__init__.py"), set(mods))
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else TOP


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def _reaches(graph: dict[str, set[str]], start: str, target: str) -> list[str] | None:
    """A chain of imports from `start` to the outside package `target`, if there is one."""
    seen = {start}
    todo = [[start]]
    while todo:
        chain = todo.pop()
        for nxt in sorted(graph.get(chain[-1], ())):
            if nxt == target:
                return chain + [nxt]
            if nxt in graph and nxt not in seen:
                seen.add(nxt)
                todo.append(chain + [nxt])
    return None


def test_every_module_is_in_a_layer():
    for name in _graph():
        assert layer(name) in ALLOWED, name


def test_each_layer_imports_only_the_layers_below_it():
    graph = _graph()
    wrong = [f"{name} ({layer(name)}) imports {dep} ({layer(dep)})"
             for name, deps in graph.items() for dep in deps
             if dep in graph and layer(dep) != layer(name) and layer(dep) not in ALLOWED[layer(name)]
             and dep != "nfshunt"]
    assert not wrong, "\n".join(wrong)


def test_the_decision_side_kernel_and_observe_never_reach_os_ken():
    graph = _graph()
    for name in graph:
        if layer(name) in NO_OS_KEN:
            assert (chain := _reaches(graph, name, "os_ken")) is None, " -> ".join(chain)


def test_the_ids_logic_never_imports_the_http_server():
    """Issue 39: the calls' types live in ids/calls, so the logic that answers them does
    not take the HTTP server (and its threads, TLS and parsing) along."""
    graph = _graph()
    wrong = sorted(name for name, deps in graph.items() if IDS_SERVER in deps and name not in IDS_SERVER_USERS)
    assert not wrong, f"{', '.join(wrong)} import {IDS_SERVER}"


def test_no_module_imports_one_that_imports_it_back():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_graph_sees_function_level_relative_and_type_checking_imports():
    tree = ast.parse("from . import b\ndef f():\n    from .c import x\nif TYPE_CHECKING:\n    from ..r.d import y\n"
                     "import os_ken.ofproto\n")
    mods = {"nfshunt.p.a", "nfshunt.p.b", "nfshunt.p.c", "nfshunt.r.d"}
    assert _imports(tree, "nfshunt.p.a", False, mods) == {"nfshunt.p.b", "nfshunt.p.c", "nfshunt.r.d", "os_ken"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _reaches({"a": {"b"}, "b": {"os_ken"}}, "a", "os_ken") == ["a", "b", "os_ken"]


def test_no_class_or_function_is_too_long():
    long = []
    for name, path in _modules().items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                long.append(f"class {name}.{node.name}: {size} lines (at most {MAX_CLASS})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                long.append(f"function {name}.{node.name}: {size} lines (at most {MAX_FUNCTION})")
    assert not long, "\n".join(long)


def test_the_os_ken_app_stays_a_shim():
    with open(_modules()[APP_MODULE]) as fh:
        size = len(fh.read().splitlines())
    assert size < MAX_APP, f"{APP_MODULE}: {size} lines (under {MAX_APP})"
