"""The package's imports run one way: no module imports, at run time (at the top or inside
a function), one that imports it back, and the pure modules never import os-ken. Imports
under `if TYPE_CHECKING:` are for annotations only and are not followed."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "nfshunt")
# The decision side: no os-ken, no app (Faucet's rule: the logic runs without a switch).
PURE = ("model", "markcodec", "config", "validate", "commands", "connection", "core", "core_state", "admission",
        "confirmation", "teardown", "removal", "reconcile", "pins", "layout", "cookies", "static")


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules a module's code imports when it runs."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            return
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import a, b
                found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nfshunt."):
            found.add(node.module.split(".")[1])
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    names = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    graph = {}
    for name in names:
        with open(os.path.join(PACKAGE, f"{name}.py")) as fh:
            graph[name] = _runtime_imports(ast.parse(fh.read()), names) & names - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
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


def test_no_module_imports_one_that_imports_it_back():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    tree = ast.parse("from . import b\ndef f():\n    from .c import x\nif TYPE_CHECKING:\n    from .d import y\n")
    assert _runtime_imports(tree, {"b", "c", "d"}) == {"b", "c"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_decision_side_imports_neither_os_ken_nor_the_app():
    graph = _graph()
    for name in PURE:
        with open(os.path.join(PACKAGE, f"{name}.py")) as fh:
            text = fh.read()
        assert "os_ken" not in text, name
        assert not graph[name] & {"switch_app", "operator_api", "replies", "peers", "dispatch"}, name
